"""Tier index examples worked by hand, and what the random sequences rarely reach
(more than 64 worker slots, snapshot export/import)."""

from __future__ import annotations

import random

import pytest

from kvstream.events.model import Cleared, Removed, Stored, Tier
from kvstream.hashing import sequence_hashes
from kvstream.router.index import TieredIndex, TierOverlap, WorkerBlocks, WorkerKey

from .reference import ReferenceIndex
from .test_index_properties import check

PROMPT = [11, 12, 13, 14, 15, 16]  # local hashes


def stored(w: int, tier: Tier, ids: list[int], tokens: list[int], parent: int | None = None, rank: int = 0) -> Stored:
    return Stored(w, rank, tier, 0, 0, parent, tuple(ids), tuple(tokens))


def test_tiers_continue_where_the_previous_one_stopped() -> None:
    idx = TieredIndex()
    idx.apply(stored(1, Tier.DEVICE, [1, 2], PROMPT[:2]))
    idx.apply(stored(1, Tier.HOST_PINNED, [10, 11, 12, 13], PROMPT[:4]))  # blocks 0..3 on host
    idx.apply(stored(1, Tier.DISK, [20, 21, 22, 23, 24], PROMPT[:5]))
    idx.apply(stored(2, Tier.DISK, [30, 31, 32], PROMPT[:3]))  # no device: disk from 0
    idx.apply(stored(2, Tier.EXTERNAL, [40, 41, 42, 43], PROMPT[:4]))
    idx.apply(stored(3, Tier.HOST_PINNED, [50], [99]))  # another prompt
    assert idx.find_matches_by_tier(PROMPT) == {
        # device 0..1, host 2..3 (0..1 not counted twice), disk 4, external none.
        WorkerKey(1, 0): TierOverlap(2, 2, 1, 0),
        WorkerKey(2, 0): TierOverlap(0, 0, 3, 1),
    }
    # A gap on the device tier stops the device prefix there.
    idx.apply(Removed(1, 0, Tier.DEVICE, 0, 0, (1,)))
    assert idx.find_matches_by_tier(PROMPT)[WorkerKey(1, 0)] == TierOverlap(0, 4, 1, 0)
    assert idx.tree_sizes()[WorkerKey(1, 0)] == {
        Tier.DEVICE: 1, Tier.HOST_PINNED: 4, Tier.DISK: 5, Tier.EXTERNAL: 0,
    }


def test_rejected_and_skipped_events_are_counted_and_change_nothing() -> None:
    idx = TieredIndex()
    assert idx.apply(stored(1, Tier.DEVICE, [1, 2], PROMPT[:2])) is None
    assert idx.apply(stored(1, Tier.DEVICE, [3], [13], parent=7)) == "stored_parent_not_found"
    assert idx.apply(stored(1, Tier.HOST_PINNED, [3], [13], parent=2)) == "stored_parent_not_found"
    assert idx.apply(stored(1, Tier.DEVICE, [3, 3], [13, 14], parent=2)) == "stored_invalid"
    assert idx.apply(stored(1, Tier.DEVICE, [3, 2], [13, 14], parent=2)) == "stored_invalid"
    assert idx.apply(stored(1, Tier.DEVICE, [3], [-1], parent=2)) == "stored_invalid"
    idx.apply(Removed(1, 0, Tier.DEVICE, 0, 0, (2, 9, 2**64)))
    assert dict(idx.counters) == {
        "stored_parent_not_found": 2,
        "stored_invalid": 3,
        "removed_unknown_block": 2,
    }
    assert idx.find_matches_by_tier(PROMPT) == {WorkerKey(1, 0): TierOverlap(device=1)}


def test_aliases_cleared_and_removed_workers() -> None:
    idx = TieredIndex()
    idx.apply(stored(1, Tier.DEVICE, [1, 2], PROMPT[:2]))
    idx.apply(stored(1, Tier.DEVICE, [5, 6], PROMPT[:2]))  # the same positions, other ids
    idx.apply(Removed(1, 0, Tier.DEVICE, 0, 0, (1, 2)))
    assert idx.find_matches_by_tier(PROMPT) == {WorkerKey(1, 0): TierOverlap(device=2)}
    idx.apply(stored(1, Tier.DEVICE, [7], PROMPT[:1], rank=1))
    idx.apply(stored(1, Tier.HOST_PINNED, [8], PROMPT[:1], rank=1))
    idx.apply(Cleared(1, 1, Tier.DEVICE, 1, 0))  # rank 1's device tier only
    assert idx.find_matches_by_tier(PROMPT) == {
        WorkerKey(1, 0): TierOverlap(device=2),
        WorkerKey(1, 1): TierOverlap(host_pinned=1),
    }
    idx.apply(Cleared(1, 1, Tier.HOST_PINNED, 1, 0))
    idx.apply(Cleared(1, 0, Tier.DEVICE, 1, 0))
    assert idx.find_matches_by_tier(PROMPT) == {}
    assert idx.workers() == [WorkerKey(1, 0), WorkerKey(1, 1)]
    assert idx.remove_worker(1) == [WorkerKey(1, 0), WorkerKey(1, 1)]
    assert idx.workers() == [] and not idx.knows(1)


def test_more_than_64_slots_against_the_reference() -> None:
    rng = random.Random(5)
    fast, ref = TieredIndex(), ReferenceIndex()
    paths = [[rng.randrange(3) for _ in range(6)] for _ in range(8)]
    for w in range(100):
        for rank in range(2):
            path = paths[rng.randrange(len(paths))][: rng.randrange(1, 7)]
            tier = (Tier.DEVICE, Tier.HOST_PINNED, Tier.DISK)[rng.randrange(3)]
            ev = stored(w, tier, [w * 100 + i for i in range(len(path))], path, rank=rank)
            fast.apply(ev)
            ref.apply(ev)
    for w in range(0, 100, 7):
        fast.remove_worker(w)
        ref.remove_worker(w)
    ev = stored(500, Tier.DEVICE, [1, 2, 3], paths[0][:3])  # reuses a freed slot
    fast.apply(ev)
    ref.apply(ev)
    check(fast, ref, [p + [0, 1] for p in paths])
    # Slots are given in order (two per worker): workers from 40 on sit in the second
    # group of 64 slots, and they match too.
    matched = {k for p in paths for k in fast.find_matches_by_tier(p)}
    assert len(matched) > 100 and any(k.worker_id >= 40 for k in matched)


def test_export_import_round_trip() -> None:
    idx = TieredIndex()
    idx.apply(stored(1, Tier.DEVICE, [1, 2], PROMPT[:2]))
    idx.apply(stored(1, Tier.DEVICE, [5], PROMPT[:1]))  # an alias survives the trip
    idx.apply(stored(1, Tier.DISK, [3, 4, 6], PROMPT[:3], rank=2))
    idx.apply(Cleared(2, 0, Tier.DEVICE, 0, 0))
    parts = idx.export_worker(1)
    copy = TieredIndex()
    copy.import_worker(1, parts)
    copy.import_worker(2, idx.export_worker(2))
    assert copy.tree_sizes() == idx.tree_sizes()
    assert copy.find_matches_by_tier(PROMPT) == idx.find_matches_by_tier(PROMPT)
    copy.apply(Removed(1, 0, Tier.DEVICE, 0, 0, (1,)))  # block 5 still holds position 0
    assert copy.find_matches_by_tier(PROMPT)[WorkerKey(1, 0)] == TierOverlap(device=2)
    copy.apply(Removed(1, 0, Tier.DEVICE, 0, 0, (5,)))
    assert WorkerKey(1, 0) not in copy.find_matches_by_tier(PROMPT)
    assert dict(copy.blocks(WorkerKey(1, 2), Tier.DISK)) == dict(
        zip([3, 4, 6], sequence_hashes(PROMPT[:3]))
    )
    with pytest.raises(ValueError, match="already known"):
        copy.import_worker(1, parts)
    with pytest.raises(ValueError, match="repeat"):
        TieredIndex().import_worker(3, [WorkerBlocks(0, Tier.DEVICE, [1, 1], [5, 6])])
