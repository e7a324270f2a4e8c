"""Issue 13, findings 2 and 3: no producer may lock out, impersonate or drown workers.

Against the real broker, with replicas started in process and the real publisher
(kvstream.worker.publisher) as the honest worker. Each case failed on the old main:

- a ``cleared`` with epoch 2**64-1 for a live worker took it to 0 blocks and sent every
  later batch of it to the DLQ as stale, on every replica, for good;
- a batch that took a worker's next event id injected blocks and silently dropped the
  real event;
- thousands of phantom workers (``cleared`` with made-up ids) became routing candidates
  and took every uncached prompt;
- rogue workers could store any number of blocks.
"""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Producer

from kvstream.events.codec import EventCodec
from kvstream.events.model import Cleared, EventBatch, Stored, Tier
from kvstream.kafka.config import producer_config
from kvstream.replica.authority import (
    EPOCH_AHEAD,
    EVENT_TOO_LARGE,
    KEY_MISMATCH,
    NOT_ALLOWED,
    TOO_MANY_WORKERS,
    WORKER_FULL,
    worker_key,
)
from kvstream.replica.fold import DISPLACED, ID_CONFLICT, STALE_EPOCH
from kvstream.hashing import local_hashes
from kvstream.settings import FoldSettings, Settings
from kvstream.worker.consolidator import Consolidator
from kvstream.worker.source_events import SourceStored

from tests.faults.helpers import agrees_with_log
from tests.faults.test_worker_faults import _last_event_id, blocks, epoch_truth, publisher, store, until
from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import produce, read_all, start, wait_caught_up

pytestmark = [pytest.mark.faults, pytest.mark.kafka]

U64 = (1 << 64) - 1
D = Tier.DEVICE
CODEC = EventCodec()


def chain(cons: Consolidator, first: int, n: int) -> None:
    """The worker's cache gains a chain of ``n`` blocks of its own tokens (``first`` seeds
    both the engine's block ids and the tokens, so chains never share a prefix)."""
    tokens = local_hashes(list(range(first * 1000, first * 1000 + 16 * n)), 16)
    cons.on_source_event(SourceStored(D, 0, None, tuple(range(first, first + n)), tuple(tokens)))


def _produce_raw(settings: Settings, batches: list[EventBatch]) -> None:
    """What a buggy or rogue producer sends: well-formed batches, keyed as a worker's."""
    p = Producer(producer_config(settings))
    for b in batches:
        p.produce(settings.topics.name("events"), CODEC.encode(b), key=worker_key(b.worker_id))
        p.poll(0)
    assert p.flush(60) == 0


def _with_fold(settings: Settings, **fold) -> Settings:
    return settings.model_copy(update={"fold": FoldSettings(**fold)})


@pytest.mark.timeout(120)
def test_an_absurd_epoch_or_a_wrong_key_cannot_lock_a_worker_out(kafka_topics: Settings) -> None:
    pub, cons = publisher(kafka_topics, 71, listen_control=False)
    r = start(kafka_topics)
    try:
        store(cons, 100, 6)
        assert pub.flush(30) == 0
        _produce_raw(kafka_topics, [EventBatch(71, U64, 10_000, (Cleared(71, 0, D, U64, 0),))])
        # A misconfigured producer: a plausible newer epoch, under another worker's key.
        newer = pub.epoch + 1
        p = Producer(producer_config(kafka_topics))
        p.produce(kafka_topics.topics.name("events"), CODEC.encode(EventBatch(71, newer, 10_000, (Cleared(71, 0, D, newer, 0),))),
                  key=worker_key(9))
        assert p.flush(30) == 0
        chain(cons, 106, 4)  # the worker goes on, in its own epoch
        assert pub.flush(30) == 0
        wait_caught_up(r, kafka_topics)
        with r.lock:
            assert r.fold.workers[71].epoch == pub.epoch
            assert blocks(r.fold, 71) == epoch_truth(kafka_topics, 71, pub.epoch) and len(blocks(r.fold, 71)) == 10
            assert r.fold.counters[EPOCH_AHEAD] == 1 and r.fold.counters[KEY_MISMATCH] == 1
            assert r.fold.counters[STALE_EPOCH] == 0
        dlq = read_all(kafka_topics, "dlq", want=2)
        assert sorted(dict(m.headers())["kvstream-error"].decode().split(":")[0] for m in dlq) == [EPOCH_AHEAD, KEY_MISMATCH]
    finally:
        r.stop()
        pub.close()
    agrees_with_log(r, kafka_topics)
    # A replica started afterwards agrees.
    fresh = start(kafka_topics)
    try:
        wait_caught_up(fresh, kafka_topics)
        with fresh.lock:
            assert blocks(fresh.fold, 71) == epoch_truth(kafka_topics, 71, pub.epoch)
    finally:
        fresh.stop()


@pytest.mark.timeout(120)
def test_a_stolen_event_id_is_detected_and_healed_by_resync(kafka_topics: Settings) -> None:
    pub, cons = publisher(kafka_topics, 72, listen_control=True)
    r = start(kafka_topics, resync_min_interval_s=0.0)
    try:
        store(cons, 200, 5)
        assert pub.flush(30) == 0
        wait_caught_up(r, kafka_topics)
        # Another producer takes the worker's next event id and injects blocks.
        nxt = _last_event_id(kafka_topics, 72, pub.epoch) + 1
        rogue = Stored(72, 0, D, pub.epoch, nxt, None, (555_001, 555_002), (1, 2))
        _produce_raw(kafka_topics, [EventBatch(72, pub.epoch, 60_000, (rogue,))])
        chain(cons, 205, 3)  # the real event with that id
        assert pub.flush(30) == 0
        until(lambda: r.fold.counters[ID_CONFLICT] == 1, "the id conflict")
        first = pub.epoch
        until(lambda: pub.stats.resyncs == 1, "the worker's resync", tick=lambda: pub.poll(cons))
        assert pub.flush(30) == 0 and pub.epoch > first
        wait_caught_up(r, kafka_topics)
        with r.lock:
            healed = blocks(r.fold, 72)
        assert healed == epoch_truth(kafka_topics, 72, pub.epoch) and len(healed) == 8
        assert not {h for _, _, h in healed} & {555_001, 555_002}
    finally:
        r.stop()
        pub.close()
    agrees_with_log(r, kafka_topics)


def _uncached_routes(r, n: int) -> dict[int, int]:
    """Route ``n`` prompts nobody holds; count the chosen workers."""
    out: dict[int, int] = {}
    for i in range(n):
        wid = r.route(list(range(10_000 + i * 64, 10_064 + i * 64)), query_only=True).worker.worker_id
        out[wid] = out.get(wid, 0) + 1
    return out


PHANTOMS = 2_000  # the finding had 20,000; the bound shows at any count above the limit


@pytest.mark.timeout(180)
def test_phantom_workers_are_refused_by_the_allow_list_and_bounded_without_it(kafka_topics: Settings) -> None:
    w = FakeWorkerLog(73)
    produce(kafka_topics, [(73, w.batch(w.cleared(), w.stored(list(range(16 * 8)))))])
    phantoms = [EventBatch(10_000 + i, 1, 10_000, (Cleared(10_000 + i, 0, D, 1, 0),)) for i in range(PHANTOMS)]
    t0 = time.monotonic()
    _produce_raw(kafka_topics, phantoms)
    produced_s = time.monotonic() - t0
    allow = _with_fold(kafka_topics, allowed_workers=[73])
    limit = 8
    bounded = _with_fold(kafka_topics, max_workers_per_partition=limit)
    a, b = start(allow), start(bounded)
    try:
        wait_caught_up(a, kafka_topics)
        wait_caught_up(b, kafka_topics)
        with a.lock:
            assert set(a.fold.workers) == {73} and {k.worker_id for k in a.router.workers()} == {73}
            assert a.fold.counters[NOT_ALLOWED] == PHANTOMS
        assert _uncached_routes(a, 40) == {73: 40}
        with b.lock:
            per_partition: dict[int, int] = {}
            for wlog in b.fold.workers.values():
                per_partition[wlog.partition] = per_partition.get(wlog.partition, 0) + 1
            assert max(per_partition.values()) == limit
            admitted = len(b.fold.workers)
            # Phantoms store nothing: each newcomer displaces the one seen least recently
            # (issue 28); the real worker, which holds blocks, is never displaced.
            assert 73 in b.fold.workers and b.fold.counters[TOO_MANY_WORKERS] == 0
            assert b.fold.counters[DISPLACED] == PHANTOMS + 1 - admitted
        # The admitted phantoms were never registered: none is a routing candidate.
        assert _uncached_routes(b, 40) == {73: 40}
        assert a.metrics.dlq._value.get() == PHANTOMS
    finally:
        a.stop()
        b.stop()
    agrees_with_log(a, allow)
    agrees_with_log(b, bounded)
    print(f"FAULTS phantoms={PHANTOMS} produced_s={produced_s:.2f} admitted_with_limit={admitted} "
          f"per_partition_limit={limit} admitted_with_allow_list=0")


@pytest.mark.timeout(180)
def test_rogue_block_floods_are_bounded_per_event_and_per_worker(kafka_topics: Settings) -> None:
    # The finding: 9 rogue workers x 10^6 blocks. Scaled down: 9 x 13,500 blocks against
    # a worker limit of 2,000 and an event limit of 5,000.
    settings = _with_fold(kafka_topics, max_blocks_per_worker=2_000, max_blocks_per_event=5_000)
    batches = []
    for wid in range(80, 89):
        ev_id = 0
        events = [Cleared(wid, 0, D, 1, ev_id)]
        parent = None
        for chunk in range(5):  # 1,500 each: the first fits, the next four overflow
            ev_id += 1
            hashes = tuple(range(wid * 10**6 + chunk * 1_500, wid * 10**6 + (chunk + 1) * 1_500))
            events.append(Stored(wid, 0, D, 1, ev_id, parent, hashes, hashes))
            parent = hashes[-1]
        ev_id += 1
        big = tuple(range(wid * 10**7, wid * 10**7 + 6_000))  # over the event limit
        events.append(Stored(wid, 0, D, 1, ev_id, None, big, big))
        batches.append(EventBatch(wid, 1, 10_000, tuple(events)))
    _produce_raw(kafka_topics, batches)
    r = start(settings)
    try:
        wait_caught_up(r, kafka_topics)
        with r.lock:
            held = {wid: r.router.worker_blocks(wid) for wid in range(80, 89)}
            assert r.fold.counters[EVENT_TOO_LARGE] == 9 and r.fold.counters[WORKER_FULL] == 9 * 4
        assert held == {wid: 1_500 for wid in range(80, 89)}
        assert r.metrics.dlq._value.get() == 9  # one DLQ copy per batch, every reason in it
    finally:
        r.stop()
    agrees_with_log(r, settings)


@pytest.mark.timeout(120)
def test_a_record_from_the_future_cannot_expire_a_partition(kafka_topics: Settings) -> None:
    """A producer whose clock is an hour ahead (or that stamps records on purpose) would
    move its partition's log clock an hour on and expire every worker there; the events
    topic's ``message.timestamp.after.max.ms`` makes the broker refuse it."""
    w = FakeWorkerLog(74)
    produce(kafka_topics, [(74, w.batch(w.cleared(), w.stored(list(range(16 * 4)))))])
    errors: list = []
    p = Producer(producer_config(kafka_topics, **{"enable.idempotence": False}))
    p.produce(kafka_topics.topics.name("events"), None, key=worker_key(74),
              timestamp=int(time.time() * 1000) + 3_600_000, headers=[("kvstream-tick", b"")],
              on_delivery=lambda err, _m: errors.append(err))
    p.flush(30)
    assert errors and errors[0] is not None and errors[0].name() == "INVALID_TIMESTAMP", errors
    r = start(kafka_topics)
    try:
        wait_caught_up(r, kafka_topics)
        with r.lock:
            assert r.router.worker_blocks(74) == 4 and r.fold.counters["worker_expired"] == 0
    finally:
        r.stop()
