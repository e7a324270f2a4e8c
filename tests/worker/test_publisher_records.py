"""Publisher pieces that need no broker: resync request records and option checks."""

from __future__ import annotations

import pytest

from kvstream.events.codec import AvroCodec
from kvstream.worker.publisher import RESYNC_RECORD, PublisherOptions, ResyncRequest


@pytest.mark.parametrize("worker_id", [None, 0, 42, (1 << 63) - 1, 1 << 63, (1 << 64) - 1])
def test_resync_request_round_trips_u64_worker_ids(worker_id):
    codec = AvroCodec()
    req = ResyncRequest(worker_id, "replica-7", "offset below earliest", 1_700_000_000_000)
    name, record = codec.decode(codec.encode(RESYNC_RECORD, req.to_record()))
    assert name == RESYNC_RECORD
    assert ResyncRequest.from_record(record) == req


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"worker_id": -1}, "not a u64"),
        ({"worker_id": 1 << 64}, "not a u64"),
        ({"worker_id": 1, "max_batch_blocks": 0}, "must be positive"),
        ({"worker_id": 1, "heartbeat_s": 0}, "heartbeat_s must be positive"),
        ({"worker_id": 1, "lease_ms": 2000, "heartbeat_s": 2}, "must be longer than the heartbeat"),
    ],
)
def test_bad_options_say_why(kw, message):
    with pytest.raises(ValueError, match=message):
        PublisherOptions(**kw)
