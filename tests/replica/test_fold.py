"""The fold's rules (kvstream.replica.fold): dedup, epochs, gaps, leases in log time, DLQ."""

from __future__ import annotations

import random

from kvstream.events.model import Tier
from kvstream.hashing import local_hashes
from kvstream.replica import fold as F
from kvstream.router.index import TierOverlap, WorkerKey

from tests.replica.helpers import FakeWorkerLog, new_fold

TOKENS = list(range(16 * 8))


def device_match(fold, tokens=TOKENS) -> dict:
    return {k: m.device for k, m in fold.router.find_matches_by_tier(local_hashes(tokens)).items()}


def test_applies_and_tracks_offsets() -> None:
    fold = new_fold()
    w = FakeWorkerLog(7)
    out = fold.apply_record(0, 0, 1000, w.batch(w.cleared(), w.stored(TOKENS)))
    assert out.dlq_reason is None and out.resync == () and out.applied_events == 2
    assert device_match(fold) == {WorkerKey(7, 0): 8}
    assert fold.next_offsets() == {0: 1}


def test_duplicate_events_are_dropped_once_applied() -> None:
    fold = new_fold()
    w = FakeWorkerLog(1)
    first = w.batch(w.cleared(), w.stored(TOKENS[:64]))
    fold.apply_record(0, 0, 1, first)
    # The same record again (a producer retry that slipped through) changes nothing.
    out = fold.apply_record(0, 1, 2, first)
    assert out.applied_events == 0
    assert fold.counters[F.DUPLICATE] == 2
    assert device_match(fold) == {WorkerKey(1, 0): 4}


def test_gap_is_applied_counted_and_asks_for_resync() -> None:
    fold = new_fold()
    w = FakeWorkerLog(2)
    fold.apply_record(0, 0, 1, w.batch(w.cleared(), w.stored(TOKENS[:32])))
    w.stored(TOKENS[:64], start_block=2)  # lost: never published
    out = fold.apply_record(0, 1, 2, w.batch(w.stored(TOKENS[:96], start_block=4)))
    assert fold.counters[F.GAP] == 1
    assert out.resync == (2,)
    # The store's parent was in the lost event: rejected by the index, copied to the DLQ.
    assert out.dlq_reason is not None and "stored_parent_not_found" in out.dlq_reason


def test_new_epoch_replaces_old_state_and_old_epoch_is_stale() -> None:
    fold = new_fold()
    old = FakeWorkerLog(3, epoch=10)
    fold.apply_record(0, 0, 1, old.batch(old.cleared(), old.stored(TOKENS)))
    new = FakeWorkerLog(3, epoch=11)
    # The new incarnation's `cleared` is lost: the epoch change alone wipes the state.
    new.cleared()
    out = fold.apply_record(0, 1, 2, new.batch(new.stored(TOKENS[:32])))
    assert fold.counters[F.NO_CLEARED] == 1 and out.resync == (3,)
    assert device_match(fold) == {WorkerKey(3, 0): 2}
    out = fold.apply_record(0, 2, 3, old.batch(old.stored(TOKENS[:64], start_block=2)))
    assert out.dlq_reason is not None and out.dlq_reason.startswith(F.STALE_EPOCH)
    assert device_match(fold) == {WorkerKey(3, 0): 2}


def test_undecodable_record_goes_to_dlq_and_offset_advances() -> None:
    fold = new_fold()
    out = fold.apply_record(2, 41, 5, b"\xc3\x01garbage")
    assert out.dlq_reason is not None and out.dlq_reason.startswith(F.DECODE_ERROR)
    out = fold.apply_record(2, 42, 6, None)
    assert out.dlq_reason is not None
    assert fold.next_offsets() == {2: 43}
    assert fold.counters[F.DECODE_ERROR] == 2


def test_lease_expiry_in_log_time_per_partition() -> None:
    fold = new_fold()
    a, b = FakeWorkerLog(1, lease_ms=1000), FakeWorkerLog(2, lease_ms=1000)
    fold.apply_record(0, 0, 10_000, a.batch(a.cleared(), a.stored(TOKENS)))
    fold.apply_record(1, 0, 10_000, b.batch(b.cleared(), b.stored(TOKENS)))
    # Time moves on partition 1 only (b's heartbeats): a, on partition 0, stays.
    fold.apply_record(1, 1, 10_900, b.batch())
    fold.apply_record(1, 2, 11_800, b.batch())
    assert set(device_match(fold)) == {WorkerKey(1, 0), WorkerKey(2, 0)}
    # A tick on partition 0 past a's lease removes it, deterministically from the log.
    fold.apply_record(0, 1, 11_001, None, is_tick=True)
    assert set(device_match(fold)) == {WorkerKey(2, 0)}
    assert 1 not in fold.workers and fold.counters[F.EXPIRED] == 1
    # Heartbeats renew b's lease: still there 1.9 s after its first batch.
    fold.apply_record(1, 3, 12_700, None, is_tick=True)
    assert set(device_match(fold)) == {WorkerKey(2, 0)}


def test_cleared_wipes_its_rank_and_tier_only() -> None:
    fold = new_fold()
    w = FakeWorkerLog(5, ranks=2)
    fold.apply_record(0, 0, 1, w.batch(w.cleared(0), w.cleared(1), w.stored(TOKENS, 0), w.stored(TOKENS, 1, Tier.HOST_PINNED)))
    m = fold.router.find_matches_by_tier(local_hashes(TOKENS))
    assert m == {WorkerKey(5, 0): TierOverlap(8, 0, 0, 0), WorkerKey(5, 1): TierOverlap(0, 8, 0, 0)}
    fold.apply_record(0, 1, 2, w.batch(w.cleared(1)))  # rank 1's device tier: nothing there
    assert fold.router.find_matches_by_tier(local_hashes(TOKENS)) == m
    fold.apply_record(0, 2, 3, w.batch(w.cleared(1, Tier.HOST_PINNED)))
    assert fold.router.find_matches_by_tier(local_hashes(TOKENS)) == {WorkerKey(5, 0): TierOverlap(8, 0, 0, 0)}


def test_same_records_same_state_whatever_the_partition_interleaving() -> None:
    rng = random.Random(3)
    logs = {p: [] for p in range(3)}
    for wid in range(9):
        w = FakeWorkerLog(wid, lease_ms=500)
        p = wid % 3
        t = 1000
        logs[p].append((t, w.batch(w.cleared())))
        for _ in range(20):
            t += rng.randrange(1, 300)
            toks = [rng.randrange(4) for _ in range(16 * rng.randrange(1, 6))]
            logs[p].append((t, w.batch(w.stored(toks)) if rng.random() < 0.8 else w.batch()))
    for p in logs:
        logs[p].sort(key=lambda r: r[0])

    def run(order_seed: int):
        fold = new_fold()
        pos = {p: 0 for p in logs}
        r = random.Random(order_seed)
        while any(pos[p] < len(logs[p]) for p in logs):
            p = r.choice([p for p in logs if pos[p] < len(logs[p])])
            ts, value = logs[p][pos[p]]
            fold.apply_record(p, pos[p], ts, value)
            pos[p] += 1
        return fold.router.tree_sizes(), sorted(fold.workers), dict(fold.counters)

    assert run(1) == run(2) == run(3)
