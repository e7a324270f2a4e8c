"""Ingest's produces (DLQ copies, resync requests) leave the router lock that routes wait
on, and go out in the order the fold decided them (kvstream.replica.ingest.Outbox)."""

from __future__ import annotations

from typing import Any

import pytest

from kvstream.events.codec import AvroCodec
from kvstream.events.control import RESYNC_REQUEST, ResyncRequest
from kvstream.replica.ingest import Outbox
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.settings import Settings

from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import produce, read_all, wait_caught_up

TOKENS = list(range(16 * 8))


def test_outbox_sends_in_order_and_keeps_what_a_failed_send_left() -> None:
    sent: list[int] = []
    box = Outbox()

    def fails() -> None:
        raise RuntimeError("a send that raises")

    for item in (1, 2):
        box.later(lambda item=item: sent.append(item))
    box.later(fails)
    box.later(lambda: sent.append(3))
    with pytest.raises(RuntimeError):
        box.send()
    assert sent == [1, 2]
    box.send()  # the one after the failure was kept, not lost
    assert sent == [1, 2, 3]


@pytest.mark.kafka
def test_dlq_and_resync_are_produced_outside_the_router_lock(kafka_topics: Settings) -> None:
    r = Replica(kafka_topics, ReplicaOptions(tick_interval_s=3600.0))
    held: list[tuple[str, bool]] = []
    real = r._producer.produce

    def watched(what: str, topic: str, **kw: Any) -> bool:
        held.append((what, r.lock._is_owned()))  # RLock: held by this thread?
        return real(what, topic, **kw)

    r._producer.produce = watched  # type: ignore[method-assign]  # the same producer, watched
    r.start()
    try:
        assert r.wait_ready(60)
        w = FakeWorkerLog(2)
        first = w.batch(w.cleared(), w.stored(TOKENS[:32]))
        w.stored(TOKENS[:64], start_block=2)  # lost: never published
        gap = w.batch(w.stored(TOKENS[:96], start_block=4))  # a gap: DLQ copy and resync
        produce(kafka_topics, [(2, first), (2, gap), (2, b"\x00\x01 not avro")])
        wait_caught_up(r, kafka_topics)
        dlq = read_all(kafka_topics, "dlq", want=2)
        control = read_all(kafka_topics, "control", want=1)
    finally:
        r.stop()
    # In log order: the gap's copy, then the undecodable record's.
    assert [m.value() for m in dlq] == [gap, b"\x00\x01 not avro"]
    name, record = AvroCodec().decode(control[0].value())
    assert name == RESYNC_REQUEST and ResyncRequest.from_record(record).worker_id == 2
    assert ("dlq", False) in held and ("resync", False) in held
    assert all(not under_lock for _, under_lock in held), held
