"""Snapshot blobs of format 3 hold the core's reverse tables as raw arrays
(``TieredIndex.export_tables`` → ``WorkerTables.parse`` → ``import_workers``), and a
restore builds the owners tables from them in bulk. Checked against independent
things: the reference model fed the same events (before and after the restore, so that
the rebuilt owners and aliases are exercised by later stores and removes), an index that
replayed the same events, and damaged blobs, which are refused with the reason."""

from __future__ import annotations

import struct

import orjson
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream._native import WorkerTables
from kvstream.events.model import Cleared, Removed, Stored, Tier
from kvstream.hashing import sequence_hashes
from kvstream.replica.errors import SnapshotError
from kvstream.replica.snapshot import SnapshotMeta, unpack_worker, worker_tables
from kvstream.router.index import TieredIndex, WorkerBlocks

from tests.router.reference import TIERS, ReferenceIndex
from tests.router.test_index_properties import Pick, gen_prompt, gen_step


def restored_copy(index: TieredIndex) -> TieredIndex:
    """A new index holding every worker of ``index``, through format-3 blobs."""
    copy = TieredIndex()
    wids = sorted({k.worker_id for k in index.workers()})
    copy.import_workers({w: WorkerTables.parse(index.export_tables(w)) for w in wids})
    return copy


def same_stored_state(fast: TieredIndex, ref: ReferenceIndex, prompts: list[list[int]]) -> None:
    """What a snapshot carries: the workers, their blocks on every tier, and matching."""
    assert set(fast.workers()) == ref.known
    assert fast.tree_sizes() == ref.tree_sizes()
    for key in ref.known:
        for tier in TIERS:
            expected = {bh: sequence_hashes(p)[-1] for bh, p in ref.blocks.get((tier, key), {}).items()}
            assert dict(fast.blocks(key, tier)) == expected, (key, tier)
    for local in prompts:
        assert fast.find_matches_by_tier(local) == ref.find_matches_by_tier(local), local


def events_only(pick: Pick, ref: ReferenceIndex, workers: int) -> object:
    """A step of the property tests that the events log can hold (no expectations:
    snapshots leave them out)."""
    while True:
        step = gen_step(pick, ref, workers)
        if not isinstance(step, tuple) or step[0] == "remove_worker":
            return step


def apply(step: object, *targets: TieredIndex | ReferenceIndex) -> None:
    for t in targets:
        if isinstance(step, tuple):
            t.remove_worker(step[1])
        else:
            t.apply(step)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(1, 5))
def test_restored_index_equals_reference_and_replay(data: st.DataObject, workers: int) -> None:
    pick: Pick = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
    live, ref = TieredIndex(), ReferenceIndex()
    log: list[object] = []
    for _ in range(data.draw(st.integers(0, 60))):
        step = events_only(pick, ref, workers)
        log.append(step)
        apply(step, live, ref)
    restored = restored_copy(live)
    replayed = TieredIndex()
    for step in log:
        apply(step, replayed)
    prompts = [gen_prompt(pick, ref) for _ in range(6)]
    same_stored_state(restored, ref, prompts)
    assert restored.tree_sizes() == replayed.tree_sizes()
    # The restored index goes on folding as the model does (removes exercise the
    # owners and aliases that the restore built).
    for _ in range(data.draw(st.integers(0, 40))):
        step = events_only(pick, ref, workers)
        apply(step, restored, ref)
        same_stored_state(restored, ref, [gen_prompt(pick, ref)])
    same_stored_state(restored, ref, prompts)


def test_restore_across_slot_groups_with_aliases() -> None:
    """Over 64 worker ranks (two owners groups), positions shared by many of them, and
    two block hashes of one rank at one position (an alias)."""
    live, ref = TieredIndex(), ReferenceIndex()
    events = []
    for w in range(70):
        tier = TIERS[w % len(TIERS)]
        events.append(Stored(w, 0, tier, 0, 0, None, (1000 + w, 2000 + w), (1, 2)))
        events.append(Stored(w, 0, tier, 0, 0, None, (3000 + w,), (1,)))  # alias of 1000 + w
        events.append(Stored(w, 1, Tier.DEVICE, 0, 0, None, tuple(range(w * 10, w * 10 + 5)), (w, 7, 7, 8, 9)))
    for ev in events:
        apply(ev, live, ref)
    restored = restored_copy(live)
    prompts = [[1, 2], [1], [5, 7, 7, 8], [69, 7, 7, 8, 9]]
    same_stored_state(restored, ref, prompts)
    later = [Removed(w, 0, TIERS[w % len(TIERS)], 0, 0, (1000 + w,)) for w in range(0, 70, 2)]
    later += [Removed(w, 0, TIERS[w % len(TIERS)], 0, 0, (3000 + w,)) for w in range(0, 70, 4)]
    later += [Cleared(w, 1, Tier.DEVICE, 0, 0) for w in range(0, 70, 3)]
    for ev in later:
        apply(ev, restored, ref)
    same_stored_state(restored, ref, prompts)


def _blob() -> bytes:
    index = TieredIndex()
    index.import_worker(7, [WorkerBlocks(0, Tier.DEVICE, list(range(200)) + [2**64 - 1], list(range(1, 202)))])
    return index.export_tables(7)


def test_worker_tables_round_trip() -> None:
    index = TieredIndex()
    index.import_worker(7, [WorkerBlocks(0, Tier.DEVICE, [1, 2**64 - 1, 0], [3, 4, 5]), WorkerBlocks(3, Tier.DISK, [], [])])
    parts = unpack_worker(worker_tables(index.export_tables(7)))
    assert [(p.dp_rank, p.tier, sorted(zip(p.block_hashes, p.seq_hashes))) for p in parts] == [
        (0, Tier.DEVICE, [(0, 5), (1, 3), (2**64 - 1, 4)]),
        (3, Tier.DEVICE, []),  # a rank with no block stays known
    ]


def _part_slots_at(blob: bytes) -> tuple[int, int]:
    """(byte offset of the first part's slots, its capacity)."""
    (cap,) = struct.unpack_from("<Q", blob, 4 + 5)
    return 4 + 5 + 8 + 1 + 8, cap


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda b: b[:-1], "ends inside"),
        (lambda b: b + b"x", "after the last part"),
        (lambda b: b"", "ends inside"),
        (lambda b: b[:8] + bytes([9]) + b[9:], "tier index 9"),
        (lambda b: b[:4 + 5] + struct.pack("<Q", 2**40) + b[4 + 13:], "ends inside"),
        (lambda b: b[:4 + 13] + bytes([2]) + b[4 + 14:], "zero-key flag"),
        (lambda b: b[:4] + b[4:] + b[4:], "appears twice"),
    ],
)
def test_damaged_blobs_are_refused_with_the_reason(damage, reason: str) -> None:
    blob = _blob()
    bad = damage(blob)
    if reason == "appears twice":
        bad = struct.pack("<I", 2) + bad[4:]
    with pytest.raises(SnapshotError, match=reason):
        worker_tables(bad)


def test_tables_out_of_order_or_repeating_are_refused() -> None:
    """Blobs that pass a checksum (written so) but are no table: entries moved off their
    probe order, a key twice, no free slot. Refused, and an index is left untouched."""
    blob = _blob()
    at, cap = _part_slots_at(blob)
    words = list(struct.unpack_from(f"<{2 * cap}Q", blob, at))
    keys = words[0::2]
    full = next(i for i, k in enumerate(keys) if k and not keys[i - 1])
    empty = next(i for i, k in enumerate(keys) if not k)

    def with_keys(ks: list[int]) -> bytes:
        slots = words.copy()
        slots[0::2] = ks
        return blob[:at] + struct.pack(f"<{2 * cap}Q", *slots) + blob[at + 16 * cap:]

    moved = keys.copy()
    moved[full], moved[empty] = 0, keys[full]
    twice = keys.copy()
    twice[(full - 1) % cap] = keys[full]
    for bad, reason in ((moved, "not a valid table"), (twice, "not a valid table")):
        with pytest.raises(SnapshotError, match=reason):
            worker_tables(with_keys(bad))
    index = TieredIndex()
    with pytest.raises(ValueError, match="repeat"):
        index.import_worker(1, [WorkerBlocks(0, Tier.DEVICE, [5, 5], [1, 2])])
    assert index.tree_sizes() == {}


def test_tables_install_once() -> None:
    tables = WorkerTables.parse(_blob())
    TieredIndex().import_workers({1: tables})
    with pytest.raises(ValueError, match="installed already"):
        TieredIndex().import_workers({1: tables})


def test_an_older_format_is_refused_with_the_reason() -> None:
    """A generation written by format 2 (pairs of block and sequence hashes) is not read:
    the restore says why and replays the log."""
    raw = SnapshotMeta(1, "events", None, 1, 0).to_bytes()
    doc = orjson.loads(raw[8:])
    doc["format"] = 2
    body = orjson.dumps(doc)
    with pytest.raises(SnapshotError, match="format 2 is not 3"):
        SnapshotMeta.from_bytes(xxhash.xxh3_64_intdigest(body).to_bytes(8, "big") + body)
