"""A router with no worker left says what became of the last ones (issue 26): an expired
worker is named with the log time its lease ran out, not "none has published"."""

from __future__ import annotations

import pytest

from kvstream.events.codec import EventCodec
from kvstream.events.model import Cleared, EventBatch, Stored, Tier
from kvstream.replica.fold import LogFold
from kvstream.router import Router
from kvstream.router.errors import NoEligibleWorkerError

CODEC = EventCodec()


def test_a_route_after_the_last_worker_expired_names_it_and_when():
    fold = LogFold(Router(), CODEC.decode)
    with pytest.raises(NoEligibleWorkerError, match="none has published an event within its lease"):
        fold.router.find_best_match(list(range(32)))
    batch = EventBatch(1, 7, 1_000, (Cleared(1, 0, Tier.DEVICE, 7, 1), Stored(1, 0, Tier.DEVICE, 7, 2, None, (5,), (6,))))
    assert fold.apply_record(0, 0, 1_764_600_000_000, CODEC.encode(batch)).dlq_reason is None
    assert fold.router.find_best_match(list(range(32))).worker.worker_id == 1
    fold.apply_record(0, 1, 1_764_600_005_000, None, is_tick=True)
    with pytest.raises(NoEligibleWorkerError) as err:
        fold.router.find_best_match(list(range(32)))
    assert str(err.value) == (
        "no workers known: worker 1 expired at 2025-12-01T14:40:01.000Z (no event for its lease of 1000 ms)"
    )
