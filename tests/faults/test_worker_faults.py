"""Issue 9 (3, 4): worker faults and log loss, against the real broker, with the real
publisher (kvstream.worker.publisher) answering resync requests.

- a worker that dies without ``cleared`` is removed after its lease, in log time;
- a restarted worker's new epoch replaces its old state;
- a gap in a worker's event ids makes the replica ask for a resync, which heals it;
- offsets older than retention, and a deleted and recreated events topic, are detected
  at start; the affected workers are dropped (nothing stale is served) until their
  resync heals the replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from fastapi.testclient import TestClient

from kvstream.events.codec import EventCodec
from kvstream.events.model import EventBatch, Stored, Tier
from kvstream.hashing import local_hashes
from kvstream.kafka.config import admin_config, producer_config
from kvstream.kafka.topics import ensure_topics
from kvstream.replica.fold import EXPIRED, GAP, LogFold
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.replica.service import create_app
from kvstream.settings import Settings
from kvstream.worker.consolidator import Consolidator, Mode
from kvstream.worker.publisher import KafkaPublisher, PublisherOptions
from kvstream.worker.source_events import SourceStored

from tests.faults.helpers import agrees_with_log, read_log, reference_fold
from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import high_watermarks, produce, start, wait_caught_up

pytestmark = [pytest.mark.faults, pytest.mark.kafka]

D = Tier.DEVICE
TOKENS = local_hashes(list(range(16 * 12)), 16)


def publisher(settings: Settings, wid: int, **kw) -> tuple[KafkaPublisher, Consolidator]:
    kw.setdefault("linger_ms", 5)
    kw.setdefault("heartbeat_s", 0.5)
    kw.setdefault("lease_ms", 60_000)
    pub = KafkaPublisher(settings, PublisherOptions(worker_id=wid, **kw))
    return pub, Consolidator(pub, Mode.DEDUP)


def store(cons: Consolidator, first: int, n: int, rank: int = 0) -> None:
    """The worker's cache now holds blocks ``first .. first+n-1`` as one chain."""
    cons.on_source_event(SourceStored(D, rank, None, tuple(range(first, first + n)), tuple(TOKENS[:n])))


def blocks(fold: LogFold, wid: int) -> set[tuple[int, str, int]]:
    return {
        (p.dp_rank, p.tier.value, h)
        for p in fold.router.export_worker(wid)
        for h in p.block_hashes
    }


def epoch_truth(settings: Settings, wid: int, epoch: int) -> set[tuple[int, str, int]]:
    """The worker's blocks folded from its records of ``epoch`` alone (a resync is
    self-contained: the truth the worker published)."""
    codec = EventCodec()
    mine = [
        r for r in read_log(settings)
        if r.value is not None and not r.is_tick
        and (b := codec.decode(r.value)).worker_id == wid and b.epoch == epoch
    ]
    return blocks(reference_fold(mine), wid)


def until(cond: Callable[[], bool], what: str, timeout: float = 30.0, tick: Callable[[], None] | None = None) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for: {what}"
        if tick is not None:
            tick()
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.timeout(120)
def test_worker_killed_without_cleared_expires_after_its_lease(kafka_topics: Settings) -> None:
    lease_ms = 1500
    pub, cons = publisher(kafka_topics, 41, lease_ms=lease_ms, listen_control=False)
    r = start(kafka_topics, tick_interval_s=0.2)
    try:
        store(cons, 100, 6)
        # Alive: heartbeats keep it for three leases.
        t_end = time.monotonic() + 3 * lease_ms / 1000
        until(lambda: time.monotonic() > t_end, "heartbeats", tick=lambda: pub.poll(cons))
        assert pub.flush(30) == 0 and pub.stats.heartbeats >= 3
        wait_caught_up(r, kafka_topics)
        with r.lock:
            assert len(blocks(r.fold, 41)) == 6 and r.fold.counters[EXPIRED] == 0
        # Killed: no `cleared`, no heartbeat; only the replica's ticks move log time.
        gone_after = until(lambda: not r.router.knows(41), "lease expiry")
        with r.lock:
            assert 41 not in r.fold.workers and r.fold.counters[EXPIRED] == 1
    finally:
        r.stop()
        pub.close()
    assert gone_after >= lease_ms / 1000 * 0.5  # not removed before log time passed the lease
    # Deterministic: replaying the same log (ticks included) removes it at the same record.
    agrees_with_log(r, kafka_topics)


@pytest.mark.timeout(120)
def test_restarted_worker_new_epoch_replaces_old_state(kafka_topics: Settings) -> None:
    old, cons = publisher(kafka_topics, 42, listen_control=False)
    store(cons, 200, 8)
    assert old.flush(30) == 0
    old_epoch = old.epoch
    old.close()  # the process dies here: nothing more from this incarnation
    new, cons2 = publisher(kafka_topics, 42, listen_control=False)
    store(cons2, 300, 3)
    assert new.flush(30) == 0
    new.close()
    assert new.epoch > old_epoch
    r = start(kafka_topics)
    try:
        wait_caught_up(r, kafka_topics)
        with r.lock:
            assert r.fold.workers[42].epoch == new.epoch
            assert blocks(r.fold, 42) == epoch_truth(kafka_topics, 42, new.epoch)
            assert {h for _, _, h in blocks(r.fold, 42)}.isdisjoint(epoch_truth(kafka_topics, 42, old_epoch))
    finally:
        r.stop()


def _last_event_id(settings: Settings, wid: int, epoch: int) -> int:
    codec = EventCodec()
    ids = [
        ev.event_id
        for r in read_log(settings) if r.value is not None and not r.is_tick
        for ev in codec.decode(r.value).events
        if ev.worker_id == wid and ev.epoch == epoch and ev.dp_rank == 0
    ]
    return max(ids)


@pytest.mark.timeout(120)
def test_event_id_gap_triggers_a_resync_that_heals(kafka_topics: Settings) -> None:
    pub, cons = publisher(kafka_topics, 43, listen_control=True)
    r = start(kafka_topics, resync_min_interval_s=0.0)
    try:
        store(cons, 400, 5)
        assert pub.flush(30) == 0
        wait_caught_up(r, kafka_topics)
        # A lost batch: the next record the replica sees skips two ids and holds a block
        # the worker does not have (it was stored and evicted in the lost batches).
        last = _last_event_id(kafka_topics, 43, pub.epoch)
        bogus = Stored(43, 0, D, pub.epoch, last + 3, None, (987_654_321,), (TOKENS[0],))
        p = Producer(producer_config(kafka_topics))
        p.produce(kafka_topics.topics.name("events"), EventCodec().encode(EventBatch(43, pub.epoch, 60_000, (bogus,))), key=(43).to_bytes(8, "big"))
        assert p.flush(30) == 0
        until(lambda: r.fold.counters[GAP] == 1 and r.metrics.resync_requests._value.get() >= 1, "gap and request")
        with r.lock:
            assert (0, D.value, 987_654_321) in blocks(r.fold, 43)  # applied, but flagged
        first = pub.epoch
        until(lambda: pub.stats.resyncs == 1, "the worker's resync", tick=lambda: pub.poll(cons))
        assert pub.flush(30) == 0 and pub.epoch > first
        wait_caught_up(r, kafka_topics)
        with r.lock:
            healed = blocks(r.fold, 43)
        assert healed == epoch_truth(kafka_topics, 43, pub.epoch)
        assert len(healed) == 5 and (0, D.value, 987_654_321) not in healed
    finally:
        r.stop()
        pub.close()
    agrees_with_log(r, kafka_topics)


def _ready_status(replica: Replica) -> int:
    with TestClient(create_app(replica)) as client:
        return client.get("/readyz").status_code


def _heal_after_loss(settings: Settings, snap: Path, lose: Callable[[], None], note: str) -> None:
    """Worker state → replica snapshot → ``lose`` part of the log → restart: the loss is
    detected, the worker dropped (nothing stale) and the replica unready until the
    worker's resync heals it."""
    pub, cons = publisher(settings, 44, listen_control=True)
    try:
        store(cons, 500, 6)
        assert pub.flush(30) == 0
        first = start(settings, snapshot_dir=snap)
        wait_caught_up(first, settings)
        first.stop()  # final snapshot holds the worker
        store(cons, 600, 4, rank=1)  # written while no replica runs, then lost too
        assert pub.flush(30) == 0
        lose()
        # The wait for the resync outlasts the test's timeouts: readiness can only come
        # from the worker's answer.
        r = Replica(settings, ReplicaOptions(snapshot_dir=snap, tick_interval_s=3600.0,
                                             resync_min_interval_s=0.0, resync_wait_s=600.0))
        r.start()
        try:
            assert any(note in n for n in r.recovery_notes), r.recovery_notes
            wait_caught_up(r, settings)
            time.sleep(1.0)  # several lag updates: caught up, yet not ready
            with r.lock:
                assert not r.router.knows(44) and 44 not in r.fold.workers
                assert not r.router.workers()  # nothing of the lost log is served
            ready_unhealed = _ready_status(r)
            assert ready_unhealed == 503 and not r.ready, "ready while a dropped worker has not resynced"
            epoch = pub.epoch
            until(lambda: pub.stats.resyncs == 1, "the worker's resync", tick=lambda: pub.poll(cons))
            assert pub.flush(30) == 0 and pub.epoch > epoch
            wait_caught_up(r, settings)
            with r.lock:
                healed = blocks(r.fold, 44)
            assert healed == epoch_truth(settings, 44, pub.epoch) and len(healed) == 10
            assert r.wait_ready(30) and _ready_status(r) == 200
        finally:
            r.stop()
        agrees_with_log(r, settings)
        print(f"FAULTS loss={note} readyz_while_unhealed={ready_unhealed}")
    finally:
        pub.close()


def _retention(settings: Settings) -> Callable[[], None]:
    """Retention, on demand: delete-records moves every partition's earliest offset to
    its end, as time retention would once the records are old enough."""

    def lose() -> None:
        topic = settings.topics.name("events")
        hw = high_watermarks(settings)
        admin = AdminClient(admin_config(settings))
        futures = admin.delete_records([TopicPartition(topic, p, h) for p, h in hw.items() if h])
        for f in futures.values():
            f.result(timeout=30)

    return lose


@pytest.mark.timeout(180)
def test_offsets_older_than_retention_are_healed_by_resync(kafka_topics: Settings, tmp_path: Path) -> None:
    _heal_after_loss(kafka_topics, tmp_path / "snap", _retention(kafka_topics), "retention")


@pytest.mark.timeout(180)
def test_recreated_topic_is_detected_and_healed_by_resync(kafka_topics: Settings, tmp_path: Path) -> None:
    def recreate() -> None:
        admin = AdminClient(admin_config(kafka_topics))
        topic = kafka_topics.topics.name("events")
        admin.delete_topics([topic], request_timeout=30)[topic].result(timeout=30)
        # Deletion completes in the background; creation fails until it has.
        until(lambda: topic not in admin.list_topics(timeout=10).topics, "topic deletion")
        until(lambda: _try_create(kafka_topics), "topic re-creation", timeout=60)

    _heal_after_loss(kafka_topics, tmp_path / "snap", recreate, "recreated")


def _try_create(settings: Settings) -> bool:
    from kvstream.kafka.errors import TopicError

    try:
        ensure_topics(settings)
    except TopicError:
        return False
    return True


@pytest.mark.timeout(120)
def test_a_dropped_worker_that_never_resyncs_delays_readiness_only_for_the_wait(
    kafka_topics: Settings, tmp_path: Path
) -> None:
    w = FakeWorkerLog(45)  # a worker that is gone: nobody answers its resync request
    produce(kafka_topics, [(45, w.batch(w.cleared(), w.stored(list(range(64)))))])
    first = start(kafka_topics, snapshot_dir=tmp_path / "snap")
    wait_caught_up(first, kafka_topics)
    first.stop()
    produce(kafka_topics, [(45, w.batch())])  # its last heartbeat, past the snapshot
    _retention(kafka_topics)()
    wait_s = 3.0
    t0 = time.monotonic()
    opts = ReplicaOptions(snapshot_dir=tmp_path / "snap", tick_interval_s=3600.0, resync_wait_s=wait_s)
    r = Replica(kafka_topics, opts)
    r.start()
    try:
        assert r.wait_ready(30)
        waited = time.monotonic() - t0
        assert any("did not resync within" in n for n in r.recovery_notes), r.recovery_notes
        with r.lock:
            assert not r.router.knows(45)
    finally:
        r.stop()
    assert waited >= wait_s
