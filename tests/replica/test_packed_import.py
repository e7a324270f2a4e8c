"""Restoring workers from packed snapshot blobs (``packed_worker`` → the core's
``import_packed``) installs exactly what the list path (``unpack_worker`` →
``import_blocks``) installs; a blob whose parts overrun it is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.events.model import Tier
from kvstream.replica.snapshot import pack_worker, packed_worker, unpack_worker
from kvstream.router.index import PackedBlocks, TieredIndex, WorkerBlocks

u64 = st.integers(0, 2**64 - 1)


@st.composite
def worker_parts(draw: st.DrawFn) -> list[WorkerBlocks]:
    parts = []
    for rank in draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3, unique=True)):
        for tier in draw(st.lists(st.sampled_from(list(Tier)), min_size=1, max_size=4, unique=True)):
            blocks = draw(st.lists(u64, max_size=40, unique=True))
            seqs = draw(st.lists(u64, min_size=len(blocks), max_size=len(blocks)))
            parts.append(WorkerBlocks(rank, tier, blocks, seqs))
    return parts


def exported(index: TieredIndex, wid: int) -> list[tuple]:
    return sorted(
        (p.dp_rank, p.tier.value, sorted(zip(p.block_hashes, p.seq_hashes, strict=True)))
        for p in index.export_worker(wid)
    )


@given(st.lists(worker_parts(), min_size=1, max_size=4))
@settings(max_examples=150, deadline=None)
def test_packed_import_equals_list_import(workers: list[list[WorkerBlocks]]) -> None:
    from_lists, from_packed = TieredIndex(), TieredIndex()
    for wid, parts in enumerate(workers):
        blob = pack_worker(parts)
        from_lists.import_worker(wid, unpack_worker(blob))
        from_packed.import_worker(wid, packed_worker(blob))
    for wid in range(len(workers)):
        assert exported(from_packed, wid) == exported(from_lists, wid)
    assert from_packed.tree_sizes() == from_lists.tree_sizes()
    prompt = [h for p in workers[0] for h in p.seq_hashes][:8]
    assert from_packed.find_matches_by_tier(prompt) == from_lists.find_matches_by_tier(prompt)


def test_packed_parts_that_overrun_the_blob_are_refused() -> None:
    blob = pack_worker([WorkerBlocks(0, Tier.DEVICE, [1, 2], [3, 4])])
    for bad in (PackedBlocks(0, Tier.DEVICE, blob, len(blob) - 8, 1), PackedBlocks(0, Tier.DEVICE, blob, 17, 2**60)):
        with pytest.raises(ValueError, match="overrun"):
            TieredIndex().import_worker(1, [bad])
    index = TieredIndex()
    index.import_worker(1, packed_worker(blob))
    assert exported(index, 1) == [(0, "device", [(1, 3), (2, 4)])]
