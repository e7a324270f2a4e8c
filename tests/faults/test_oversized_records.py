"""Issue 13, finding 1: one oversized record must not kill ingest.

A 1.5 MB record, lz4-compressed by its producer so that the broker takes it, and a
1.6 MB one: both decode, both are rejected by the fold, and neither fits in a DLQ copy.
On the old main the DLQ copy raised MSG_SIZE_TOO_LARGE in the ingest thread, which
died while ``/readyz`` said 200 (64 blocks where the log had 128), and every restart
died on the same record. Now each is referenced in the DLQ (topic/partition/offset,
size, SHA-256), ingest goes on, and replicas restarted after ``kill -9`` and fresh
ones pass them and equal the reference fold.
"""

from __future__ import annotations

import hashlib
import json
import signal
import struct
from pathlib import Path

import httpx
import pytest
from confluent_kafka import Producer

from kvstream.events.codec import EVENT_BATCH, AvroCodec
from kvstream.events.wire import worker_key
from kvstream.kafka.config import producer_config
from kvstream.replica.authority import EVENT_TOO_LARGE
from kvstream.settings import Settings
from kvstream.tools.procs import free_port

from tests.faults.helpers import agrees_with_log, spawn_router, stop_process, wait_http
from tests.faults.test_worker_faults import until
from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import produce, read_all, start, wait_caught_up

pytestmark = [pytest.mark.faults, pytest.mark.kafka]

REAL = 61
ROGUE = 62
TOKENS = list(range(16 * 128))


def big_store(n_blocks: int, event_id: int) -> bytes:
    """A decodable store of ``n_blocks`` blocks (16 bytes each on the wire) that lz4
    squeezes well (its token hashes are all zero), and that any fold rejects: too many
    blocks for one event, and a parent nobody holds."""
    ev = {"dp_rank": 0, "tier": "DEVICE", "event_id": event_id, "kind": "STORED", "parent_hash": 7,
          "block_hashes": struct.pack(f"<{n_blocks}Q", *range(1, n_blocks + 1)),
          "tokens_hashes": bytes(8 * n_blocks)}
    return AvroCodec().encode(EVENT_BATCH, {"worker_id": ROGUE, "epoch": 1, "lease_ms": 10_000, "events": [ev]})


def blocks_over_http(port: int) -> int:
    body = httpx.get(f"http://127.0.0.1:{port}/v1/workers", timeout=5).json()
    ranks = body["workers"].get(str(REAL), {}).get("ranks", {})
    return sum(n for tiers in ranks.values() for n in tiers.values())


@pytest.mark.timeout(240)
def test_oversized_records_are_referenced_and_ingest_goes_on(kafka_topics: Settings, tmp_path: Path) -> None:
    # Its lease outlasts the test: log time moves on between rounds (ticks, restarts)
    # and must not expire it.
    w = FakeWorkerLog(REAL, lease_ms=10_000_000)
    produce(kafka_topics, [(REAL, w.batch(w.cleared(), w.stored(TOKENS[: 16 * 64])))])
    big = [big_store(1_500_000 // 16, 1), big_store(1_600_000 // 16, 2)]
    # The producer compresses: the broker sees well under its 1 MB message limit.
    p = Producer(producer_config(kafka_topics, **{"compression.type": "lz4", "message.max.bytes": 4_000_000}))
    for value in big:
        p.produce(kafka_topics.topics.name("events"), value=value, key=worker_key(ROGUE))
    assert p.flush(30) == 0
    del p
    produce(kafka_topics, [(REAL, w.batch(w.stored(TOKENS, start_block=64)))])

    # A live replica (in process): ready, 128 blocks, both big records referenced.
    r = start(kafka_topics)
    try:
        wait_caught_up(r, kafka_topics)
        with r.lock:
            assert r.router.worker_blocks(REAL) == 128
            assert r.fold.counters[EVENT_TOO_LARGE] == 2
        assert r.ready and not r.not_ready_reasons()
        assert r.metrics.dlq_referenced._value.get() == 2
        dlq = read_all(kafka_topics, "dlq", want=2)
        refs = [json.loads(m.value()) for m in dlq]
        assert [ref["sha256"] for ref in refs] == [hashlib.sha256(v).hexdigest() for v in big]
        assert all(ref["size"] >= len(v) and EVENT_TOO_LARGE in ref["reason"] for ref, v in zip(refs, big))
        assert all(len(m.value()) < 4096 for m in dlq)
    finally:
        r.stop()
    agrees_with_log(r, kafka_topics)
    # Misconfigured so that the copies are attempted: the producer refuses them at once
    # (MSG_SIZE_TOO_LARGE, the old main's killer), which is counted, and ingest goes on.
    r = start(kafka_topics, dlq_max_bytes=10_000_000)
    try:
        wait_caught_up(r, kafka_topics)
        with r.lock:
            assert r.router.worker_blocks(REAL) == 128
        assert r.metrics.produce_refused.labels(what="dlq", error="MSG_SIZE_TOO_LARGE")._value.get() == 2
        assert r.ready
    finally:
        r.stop()

    # kill -9, three times: each process replays the log past both records (the last
    # one from the snapshots the second one took).
    port = free_port()
    outcomes = []
    for round_ in range(3):
        snap = {"snapshot_dir": tmp_path / "snap", "snapshot_every_records": 1} if round_ else {}
        proc = spawn_router(kafka_topics, port, tmp_path / "router.log", **snap)
        try:
            wait_http(f"http://127.0.0.1:{port}/readyz", 60, proc)
            # Ready means within ready_max_lag records of the end: wait for the tail.
            until(lambda: blocks_over_http(port) == 128, "the restarted process indexes the whole log", timeout=60)
            assert proc.poll() is None
            outcomes.append(blocks_over_http(port))
        finally:
            stop_process(proc, signal.SIGKILL)
    assert outcomes == [128, 128, 128], outcomes
    # A fresh replica (no snapshot) passes them too.
    fresh = start(kafka_topics)
    try:
        wait_caught_up(fresh, kafka_topics)
        with fresh.lock:
            assert fresh.router.worker_blocks(REAL) == 128
    finally:
        fresh.stop()
    agrees_with_log(fresh, kafka_topics)
    print(f"FAULTS oversized sizes={[len(v) for v in big]} restarts={outcomes} dlq_refs=2")
