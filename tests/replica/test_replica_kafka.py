"""Replicas against the real broker (issue 5's done-when list)."""

from __future__ import annotations

import struct
import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kvstream.events.codec import AvroCodec
from kvstream.kafka.config import admin_config, consumer_config, producer_config
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.settings import Settings
from kvstream.worker.announce import register_synthetic

from tests.replica.helpers import FakeWorkerLog
from tests.replica.raw_store import raw_keys
from tests.replica.test_snapshot import matches, random_log, state

pytestmark = pytest.mark.kafka


def produce(settings: Settings, records: list[tuple[int, bytes | None]], *, register: bool = True) -> None:
    """The records, keyed by worker; ``register``: each worker registered first, as
    ``kvstream worker`` does (the routers admit registered workers only)."""
    if register:
        register_synthetic(settings, [wid for wid, _ in records])
    p = Producer(producer_config(settings))
    for wid, value in records:
        p.produce(settings.topics.name("events"), value=value, key=wid.to_bytes(8, "big"))
    assert p.flush(30) == 0


def log_records(seed: int) -> tuple[list[tuple[int, bytes]], list[list[int]]]:
    """A random log's records with their worker ids (FakeWorkerLog batches)."""
    logs, prefixes = random_log(seed, workers=8, batches=12)
    codec_worker = []
    for records in logs.values():
        for _, value in records:
            wid = AvroCodec().decode(value)[1]["worker_id"]
            codec_worker.append((wid, value))
    return codec_worker, prefixes


def high_watermarks(settings: Settings, role: str = "events") -> dict[int, int]:
    c = Consumer(consumer_config(settings))
    topic = settings.topics.name(role)
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
    finally:
        c.close()


def wait_caught_up(replica: Replica, settings: Settings, timeout: float = 60) -> None:
    """Until the replica has folded the events and the registrations written so far (every
    record of kvstream.workers since its start: nothing is compacted within a test)."""
    target = high_watermarks(settings)
    registrations = sum(high_watermarks(settings, "workers").values())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        offsets = replica.positions()  # a partition with nothing new stays where it started
        registry = replica.registry
        if all(offsets.get(p, 0) >= hw for p, hw in target.items() if hw > 0) and (
            registry.applied + sum(registry.skipped.values()) >= registrations
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"replica did not catch up: {offsets} < {target}")


def start(settings: Settings, **opts) -> Replica:
    opts.setdefault("tick_interval_s", 3600.0)
    r = Replica(settings, ReplicaOptions(**opts))
    r.start()
    assert r.wait_ready(60), "replica never became ready"
    return r


def test_two_replicas_agree(kafka_topics: Settings) -> None:
    records, prefixes = log_records(1)
    produce(kafka_topics, records)
    a, b = start(kafka_topics), start(kafka_topics)
    try:
        wait_caught_up(a, kafka_topics)
        wait_caught_up(b, kafka_topics)
        with a.lock, b.lock:
            assert state(a.fold)[0] == state(b.fold)[0]
            assert state(a.fold)[0], "the log indexed nothing"
            assert matches(a.fold, prefixes) == matches(b.fold, prefixes)
    finally:
        a.stop()
        b.stop()


def test_restart_from_snapshot_equals_never_stopped(kafka_topics: Settings, tmp_path) -> None:
    records, prefixes = log_records(2)
    half = len(records) // 2
    produce(kafka_topics, records[:half])
    steady = start(kafka_topics)
    first = start(kafka_topics, snapshot_dir=tmp_path / "snap")
    wait_caught_up(first, kafka_topics)
    first.stop()  # a clean stop takes a final snapshot
    produce(kafka_topics, records[half:])
    again = start(kafka_topics, snapshot_dir=tmp_path / "snap")
    try:
        assert again.recovery_notes == []
        restored = again.metrics.records._value.get()
        wait_caught_up(again, kafka_topics)
        wait_caught_up(steady, kafka_topics)
        with again.lock, steady.lock:
            assert state(again.fold)[0] == state(steady.fold)[0]
            assert matches(again.fold, prefixes) == matches(steady.fold, prefixes)
            # It read only the tail, not the whole log.
            assert again.metrics.records._value.get() - restored <= len(records) - half + 8
    finally:
        again.stop()
        steady.stop()


def test_corrupt_snapshot_uses_previous(kafka_topics: Settings, tmp_path) -> None:
    records, prefixes = log_records(3)
    produce(kafka_topics, records)
    r = start(kafka_topics, snapshot_dir=tmp_path / "s")
    wait_caught_up(r, kafka_topics)
    assert r.snapshotter is not None
    with r.lock:
        r.snapshotter.snapshot_now()
        r.fold.dirty.update(r.fold.workers)
        r.snapshotter.snapshot_now()
        expected = state(r.fold)[0]
    r.stop()
    from kvstream.replica.snapshot import SnapshotStore

    store = SnapshotStore(tmp_path / "s")
    newest, _ = store.head()  # type: ignore[misc]
    key = b"m" + struct.pack(">Q", newest)
    with raw_keys(store) as db:
        raw = db[key]
        db[key] = raw[:20] + b"#" + raw[21:]
    store.close()
    again = start(kafka_topics, snapshot_dir=tmp_path / "s")
    try:
        assert any("fails its checksum" in n for n in again.recovery_notes)
        wait_caught_up(again, kafka_topics)
        with again.lock:
            assert state(again.fold)[0] == expected
    finally:
        again.stop()


def read_all(settings: Settings, role: str, timeout: float = 20, want: int = 1) -> list:
    topic = settings.topics.name(role)
    c = Consumer(consumer_config(settings, **{"auto.offset.reset": "earliest", "enable.partition.eof": False}))
    c.assign([TopicPartition(topic, 0, 0)])
    out = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and len(out) < want:
            for m in c.consume(100, 0.2):
                if m.error() is None:
                    out.append(m)
    finally:
        c.close()
    return out


def test_offsets_below_retention_trigger_resync(kafka_topics: Settings, tmp_path) -> None:
    records, _ = log_records(4)
    produce(kafka_topics, records)
    r = start(kafka_topics, snapshot_dir=tmp_path / "s")
    wait_caught_up(r, kafka_topics)
    with r.lock:
        workers_p0 = sorted(w for w, l in r.fold.workers.items() if l.partition == 0)
    r.stop()
    assert workers_p0
    # Retention deletes partition 0's records (delete-records moves its earliest offset).
    produce(kafka_topics, [(workers_p0[0], FakeWorkerLog(workers_p0[0], epoch=50).batch())])
    hw = high_watermarks(kafka_topics)[0]
    admin = AdminClient(admin_config(kafka_topics))
    for f in admin.delete_records([TopicPartition(kafka_topics.topics.name("events"), 0, hw)]).values():
        f.result(timeout=30)
    again = start(kafka_topics, snapshot_dir=tmp_path / "s")
    try:
        assert any("retention" in n for n in again.recovery_notes)
        with again.lock:
            assert not any(l.partition == 0 for l in again.fold.workers.values())
        codec = AvroCodec()
        asked = {codec.decode(m.value())[1]["worker_id"] for m in read_all(kafka_topics, "control", want=len(workers_p0))}
        assert set(workers_p0) <= asked
    finally:
        again.stop()


def test_malformed_record_goes_to_dlq_and_ingest_continues(kafka_topics: Settings) -> None:
    w = FakeWorkerLog(77)
    produce(kafka_topics, [(77, b"\x00\x01 definitely not avro"), (77, w.batch(w.cleared(), w.stored(list(range(64)))))])
    r = start(kafka_topics)
    try:
        wait_caught_up(r, kafka_topics)
        with r.lock:
            assert 77 in r.fold.workers
        dlq = read_all(kafka_topics, "dlq")
        assert len(dlq) == 1 and dlq[0].value() == b"\x00\x01 definitely not avro"
        headers = dict(dlq[0].headers())
        assert b"record_undecodable" in headers["kvstream-error"]
    finally:
        r.stop()


def test_placed_request_loads_worker_on_other_replica(kafka_topics: Settings) -> None:
    w = FakeWorkerLog(5)
    tokens = list(range(16 * 4))
    produce(kafka_topics, [(5, w.batch(w.cleared(), w.stored(tokens)))])
    a, b = start(kafka_topics), start(kafka_topics)
    try:
        wait_caught_up(a, kafka_topics)
        wait_caught_up(b, kafka_topics)
        key = a.route(tokens + [1] * 40, request_id="req-1").worker
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with b.lock:
                load = b.router.load(key)
            if load is not None:
                break
            time.sleep(0.05)
        assert load is not None and load.requests == 1
        a.free("req-1")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with b.lock:
                load = b.router.load(key)
            if load is None or load.requests == 0:
                break
            time.sleep(0.05)
        assert load is None or load.requests == 0
    finally:
        a.stop()
        b.stop()
