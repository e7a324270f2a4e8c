"""The log's authority in the fold (kvstream.replica.authority): each bound is counted and
reported for the DLQ, and the outcome never depends on how partitions interleave."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.replica.authority import (
    EPOCH_AHEAD,
    EVENT_TOO_LARGE,
    KEY_MISMATCH,
    LEASE_TOO_LONG,
    NOT_ALLOWED,
    TOO_MANY_WORKERS,
    WORKER_FULL,
    LogAuthority,
    authority_from_settings,
    worker_key,
)
from kvstream.replica.fold import DISPLACED, ID_CONFLICT, STALE_EPOCH, WRONG_PARTITION, LogFold
from kvstream.router import Router
from kvstream.settings import FoldSettings

from tests.replica.helpers import CODEC, FakeWorkerLog
from tests.replica.test_snapshot import state

TOKENS = list(range(16 * 8))
T0 = 1_764_000_000_000  # ms: a record time near today
U64 = (1 << 64) - 1


def fold_with(**kw) -> LogFold:
    return LogFold(Router(), CODEC, authority_from_settings(FoldSettings(**kw)))


def blocks(fold: LogFold, wid: int) -> int:
    return fold.router.worker_blocks(wid)


def test_an_epoch_far_ahead_of_its_record_cannot_lock_a_worker_out() -> None:
    fold = fold_with()
    real = FakeWorkerLog(1, epoch=T0 * 1_000_000)
    fold.apply_record(0, 0, T0, real.batch(real.cleared(), real.stored(TOKENS)), key=worker_key(1))
    rogue = FakeWorkerLog(1, epoch=U64)
    out = fold.apply_record(0, 1, T0 + 1, rogue.batch(rogue.cleared()), key=worker_key(1))
    assert out.dlq_reason and out.dlq_reason.startswith(EPOCH_AHEAD)
    assert fold.counters[EPOCH_AHEAD] == 1 and fold.workers[1].epoch == real.epoch
    out = fold.apply_record(0, 2, T0 + 2, real.batch(real.stored(TOKENS[:16 * 9] + list(range(16)), start_block=8)), key=worker_key(1))
    assert out.dlq_reason is None and blocks(fold, 1) == 9 and fold.counters[STALE_EPOCH] == 0
    # Within the bound the epoch is accepted (counter epochs are always plausible).
    small = FakeWorkerLog(2, epoch=7)
    assert fold.apply_record(0, 3, T0, small.batch(small.cleared()), key=worker_key(2)).dlq_reason is None


def test_key_allow_list_and_lease_are_checked() -> None:
    fold = fold_with(allowed_workers=[1, 2], max_lease_ms=60_000)
    w = FakeWorkerLog(1)
    out = fold.apply_record(0, 0, T0, w.batch(w.cleared()), key=worker_key(2))
    assert out.dlq_reason.startswith(KEY_MISMATCH)
    assert fold.apply_record(0, 1, T0, w.batch(w.cleared()), key=None).dlq_reason.startswith(KEY_MISMATCH)
    x = FakeWorkerLog(3)
    assert fold.apply_record(0, 2, T0, x.batch(x.cleared()), key=worker_key(3)).dlq_reason.startswith(NOT_ALLOWED)
    long = FakeWorkerLog(2, lease_ms=10**9)
    assert fold.apply_record(0, 3, T0, long.batch(long.cleared()), key=worker_key(2)).dlq_reason.startswith(LEASE_TOO_LONG)
    assert not fold.workers and not fold.router.workers()
    assert fold.counters[KEY_MISMATCH] == 2 and fold.counters[NOT_ALLOWED] == 1 and fold.counters[LEASE_TOO_LONG] == 1
    assert fold.apply_record(0, 4, T0, w.batch(w.cleared(), w.stored(TOKENS)), key=worker_key(1)).dlq_reason is None
    assert blocks(fold, 1) == 8


def test_block_limits_per_event_and_per_worker() -> None:
    fold = fold_with(max_blocks_per_event=6, max_blocks_per_worker=10)
    w = FakeWorkerLog(1)
    out = fold.apply_record(0, 0, T0, w.batch(w.cleared(), w.stored(TOKENS[:16 * 7])), key=worker_key(1))
    assert EVENT_TOO_LARGE in out.dlq_reason and blocks(fold, 1) == 0
    toks = list(range(1000, 1000 + 16 * 12))
    fold.apply_record(0, 1, T0, w.batch(w.stored(toks[:16 * 6])), key=worker_key(1))
    out = fold.apply_record(0, 2, T0, w.batch(w.stored(toks[:16 * 11], start_block=6)), key=worker_key(1))
    assert WORKER_FULL in out.dlq_reason and blocks(fold, 1) == 6
    fold.apply_record(0, 3, T0, w.batch(w.stored(toks[:16 * 10], start_block=6)), key=worker_key(1))
    assert blocks(fold, 1) == 10
    assert fold.counters[EVENT_TOO_LARGE] == 1 and fold.counters[WORKER_FULL] == 1


def test_workers_per_partition_are_bounded_and_freed_by_expiry() -> None:
    fold = fold_with(max_workers_per_partition=3)
    for wid in range(5):  # workers that store blocks count against the limit
        w = FakeWorkerLog(wid, lease_ms=1000)
        fold.apply_record(0, wid, T0, w.batch(w.cleared(), w.stored(list(range(16)))), key=worker_key(wid))
    assert sorted(fold.workers) == [0, 1, 2] and fold.counters[TOO_MANY_WORKERS] == 2
    w = FakeWorkerLog(9, lease_ms=1000)
    fold.apply_record(1, 0, T0, w.batch(w.cleared()), key=worker_key(9))  # another partition
    assert 9 in fold.workers
    fold.apply_record(0, 5, T0 + 5000, None, is_tick=True)  # the three expire
    # Worker 9's epoch on partition 0 outranks the same epoch on partition 1: it moves,
    # into a slot the expired workers freed.
    fold.apply_record(0, 6, T0 + 5000, w.batch(), key=worker_key(9))
    assert fold.workers[9].partition == 0 and fold.counters[WRONG_PARTITION] == 0
    out = fold.apply_record(1, 1, T0 + 5000, w.batch(), key=worker_key(9))
    assert out.dlq_reason.startswith(WRONG_PARTITION) and out.resync == (9,)


def test_a_stolen_event_id_is_a_conflict_that_asks_for_a_resync() -> None:
    fold = LogFold(Router(), CODEC, LogAuthority())
    w = FakeWorkerLog(1)
    fold.apply_record(0, 0, 1, w.batch(w.cleared(), w.stored(TOKENS[:32])))
    thief = FakeWorkerLog(1)
    thief.next_id = dict(w.next_id)
    fold.apply_record(0, 1, 2, thief.batch(thief.stored(list(range(5000, 5032)))))
    out = fold.apply_record(0, 2, 3, w.batch(w.stored(TOKENS[:64], start_block=2)))
    assert fold.counters[ID_CONFLICT] == 1 and out.resync == (1,) and ID_CONFLICT in out.dlq_reason
    # A redelivered copy of the same event is a plain duplicate.
    again = fold.apply_record(0, 3, 4, thief.batch(thief.stored(list(range(5000, 5032)))))
    assert again.resync == ()


# -- topology: one worker id on several partitions ----------------------------------


def _records(seed: int) -> list[tuple[int, int, bytes]]:
    """(partition, timestamp, value) of one worker id publishing on three partitions: an
    epoch that moves to another partition midway (partitions added), a newer epoch on
    another, an old zombie incarnation; each partition's records in offset order."""
    rng = random.Random(seed)
    out: dict[int, list[tuple[int, bytes]]] = {0: [], 1: [], 2: []}
    ts = 1000
    for epoch, parts in ((5, (0, 2)), (6, (2,)), (4, (1,))):
        w = FakeWorkerLog(7, epoch=epoch)
        first = True
        for _ in range(rng.randrange(2, 6)):
            p = rng.choice(parts)
            ts += rng.randrange(1, 50)
            toks = [rng.randrange(100) for _ in range(16 * rng.randrange(1, 4))]
            events = ([w.cleared()] if first else []) + [w.stored(toks)]
            first = False
            out[p].append((ts, w.batch(*events)))
    return [(p, ts, v) for p, recs in out.items() for ts, v in recs]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.randoms(use_true_random=False))
def test_fold_outcome_does_not_depend_on_partition_interleaving(seed: int, rnd: random.Random) -> None:
    recs = _records(seed)

    def fold_in(order: list[tuple[int, int, bytes]]) -> tuple:
        fold = fold_with()
        offsets: dict[int, int] = {}
        for p, ts, v in order:
            off = offsets.get(p, 0)
            offsets[p] = off + 1
            fold.apply_record(p, off, ts, v, key=worker_key(7))
        return state(fold)

    by_partition = sorted(recs, key=lambda r: r[0])
    backwards = sorted(recs, key=lambda r: -r[0])
    # A random interleaving that keeps each partition's own order.
    queues = {p: [r for r in recs if r[0] == p] for p in (0, 1, 2)}
    mixed = []
    while any(queues.values()):
        p = rnd.choice([p for p, q in queues.items() if q])
        mixed.append(queues[p].pop(0))
    assert fold_in(by_partition) == fold_in(mixed) == fold_in(backwards)


def test_workers_without_blocks_make_room_least_recently_seen_first() -> None:
    """Issue 28: phantoms (``cleared`` only, never a block) cannot crowd out real workers:
    a newcomer on a full partition displaces the block-less worker seen least recently."""
    fold = fold_with(max_workers_per_partition=3)
    real = FakeWorkerLog(1, lease_ms=10**6)
    fold.apply_record(0, 0, T0, real.batch(real.cleared(), real.stored(list(range(32)))), key=worker_key(1))
    for i, wid in enumerate((10, 11)):
        w = FakeWorkerLog(wid, lease_ms=10**6)
        fold.apply_record(0, 1 + i, T0 + i, w.batch(w.cleared()), key=worker_key(wid))
    w10 = FakeWorkerLog(10, lease_ms=10**6)
    fold.apply_record(0, 3, T0 + 5, w10.batch(), key=worker_key(10))  # 10 heartbeats: 11 is older
    honest = FakeWorkerLog(2, lease_ms=10**6)
    fold.apply_record(0, 4, T0 + 6, honest.batch(honest.cleared()), key=worker_key(2))
    assert sorted(fold.workers) == [1, 2, 10] and fold.counters[DISPLACED] == 1
    fold.apply_record(0, 5, T0 + 7, honest.batch(honest.stored(list(range(16)))), key=worker_key(2))
    for j, wid in enumerate(range(100, 104)):  # a flood of phantoms takes turns in one slot
        w = FakeWorkerLog(wid, lease_ms=10**6)
        fold.apply_record(0, 6 + j, T0 + 8 + j, w.batch(w.cleared()), key=worker_key(wid))
    assert sorted(fold.workers) == [1, 2, 103] and fold.counters[TOO_MANY_WORKERS] == 0
    w = FakeWorkerLog(200, lease_ms=10**6)  # a newcomer with blocks displaces the last phantom
    fold.apply_record(0, 10, T0 + 20, w.batch(w.cleared(), w.stored(list(range(16)))), key=worker_key(200))
    assert sorted(fold.workers) == [1, 2, 200]
    w = FakeWorkerLog(201, lease_ms=10**6)  # now every worker there holds blocks: refused
    fold.apply_record(0, 11, T0 + 21, w.batch(w.cleared()), key=worker_key(201))
    assert 201 not in fold.workers and fold.counters[TOO_MANY_WORKERS] == 1 and fold.counters[DISPLACED] == 6
