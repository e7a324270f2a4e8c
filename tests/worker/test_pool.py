"""Tiered block pool: registration, eviction order, pins, events, bad input."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvstream.events.model import Tier  # noqa: E402
from kvstream.worker.errors import (  # noqa: E402
    BlockPinnedError,
    DiskTierError,
    LayoutError,
    PoolConfigError,
    PoolExhaustedError,
    UnknownBlockError,
)
from kvstream.worker.layout import BlockLayout, capacity_blocks, runs  # noqa: E402
from kvstream.worker.pool import DiskBlocks, NewBlock, PoolOptions, TieredBlockPool  # noqa: E402
from kvstream.worker.source_events import SourceRemoved, SourceStored  # noqa: E402
from kvstream.worker.synthetic import block_content  # noqa: E402

from .conftest import SMALL, chain, checksum, expected, put  # noqa: E402
from .counts import allocated, pinned  # noqa: E402

G1, G2, G3 = Tier.DEVICE, Tier.HOST_PINNED, Tier.DISK


def test_register_emits_one_store_per_chain(make_pool, sink):
    pool = make_pool()
    local, seq = chain(3)
    other_local, other_seq = chain(1, start=1000)
    slots = pool.device.allocate(4)
    for s, h in zip(slots, seq + other_seq):
        pool.write_block(s, block_content(SMALL, h))
    blocks = [NewBlock(slots[i], seq[i], seq[i - 1] if i else None, local[i]) for i in range(3)]
    blocks.append(NewBlock(slots[3], other_seq[0], None, other_local[0]))
    assert pool.device.register(blocks, pin=False) == slots
    assert sink.take() == [
        SourceStored(G1, 0, None, tuple(seq), tuple(local)),
        SourceStored(G1, 0, None, tuple(other_seq), tuple(other_local)),
    ]
    assert pool.device.match(seq) == 3 and pool.device.match([seq[0], 12345, seq[2]]) == 1
    assert checksum(pool.read_block(G1, seq[1])) == expected(seq[1])


def test_duplicate_registration_keeps_the_first_slot(make_pool, sink):
    pool = make_pool()
    local, seq = chain(1)
    first = put(pool, local, seq)
    sink.take()
    again = pool.device.allocate(1)
    assert again != first
    assert pool.device.register([NewBlock(again[0], seq[0], None, local[0])], pin=True) == first
    assert sink.take() == []  # nothing new is held
    assert pool.device.free_blocks == 7 and pool.device.info(seq[0]).pins == 1


def test_register_needs_the_parent_on_the_tier(make_pool, sink):
    pool = make_pool()
    local, seq = chain(3)
    slots = pool.device.allocate(2)
    with pytest.raises(UnknownBlockError, match="register a block after its parent"):
        pool.device.register([NewBlock(slots[0], seq[1], seq[0], local[1]), NewBlock(slots[1], seq[2], seq[1], local[2])])
    assert len(pool.device) == 0 and allocated(pool, pool.device) == 2 and sink.events == []
    assert pool.device.register([NewBlock(slots[0], seq[0], None, local[0]), NewBlock(slots[1], seq[1], seq[0], local[1])], pin=False) == slots


def test_a_chain_is_evicted_from_its_tail(make_pool, sink):
    pool = make_pool(device=3, disk=None)
    local, seq = chain(3)
    put(pool, local, seq, pin=True)
    pool.device.unpin(seq)
    sink.take()
    pool.device.allocate(2)
    assert sink.take() == [SourceRemoved(G1, 0, (seq[2], seq[1]))]


def test_a_parent_outlives_its_children_even_when_less_recent(make_pool, sink):
    """The root is the least recent block, but its child is held: the child goes first."""
    pool = make_pool(device=3, disk=None)
    local, seq = chain(2)
    put(pool, local, seq[:1])
    put(pool, local, seq, first=1)  # the child, registered after its parent: more recent
    other_local, other = chain(1, start=500)
    put(pool, other_local, other)
    sink.take()
    pool.device.allocate(1)
    assert sink.take() == [SourceRemoved(G1, 0, (seq[1],))]
    pool.device.allocate(2)  # the parent went back to the recent end: it is used with its child
    assert sink.take() == [SourceRemoved(G1, 0, (other[0], seq[0]))]


def test_a_hit_refreshes_the_copies_on_every_tier(make_pool, sink):
    pool = make_pool(device=4, host=2, disk=None)
    hashes = []
    for i in range(2):
        local, seq = chain(1, start=100 * i)
        put(pool, local, seq)
        slot = pool.host.allocate(1)
        pool.host.register([NewBlock(slot[0], seq[0], None, local[0])], pin=False)
        hashes.append(seq[0])
    pool.device.pin([hashes[0]], hit=True)  # a G1 hit: the G2 copy becomes the most recent too
    pool.device.unpin([hashes[0]])
    sink.take()
    pool.host.allocate(1)
    assert sink.take() == [SourceRemoved(G2, 0, (hashes[1],))]


def test_eviction_lowest_priority_then_lru(make_pool, sink):
    pool = make_pool(device=4, disk=None)
    hashes = []
    for i, priority in enumerate([5, 0, 5, 0]):
        local, seq = chain(1, start=100 * i)
        put(pool, local, seq, priority=priority)
        hashes.append(seq[0])
    pool.device.pin([hashes[1]])  # used again: most recent of priority 0, and pinned
    pool.device.unpin([hashes[1]])
    sink.take()
    pool.device.allocate(1)
    assert sink.take() == [SourceRemoved(G1, 0, (hashes[3],))]
    pool.device.allocate(2)  # priority 0 first (hashes[1]), then the older priority 5 block
    assert sink.take() == [SourceRemoved(G1, 0, (hashes[1], hashes[0]))]
    assert set(pool.device.hashes()) == {hashes[2]}


def test_pinned_blocks_are_not_evicted_and_exhaustion_changes_nothing(make_pool, sink):
    pool = make_pool(device=3, disk=None)
    local, seq = chain(3)
    put(pool, local, seq, pin=True)
    pool.device.unpin([seq[2]])
    sink.take()
    assert (pool.device.evictable_blocks, pinned(pool, pool.device)) == (1, 2)
    with pytest.raises(PoolExhaustedError, match="2 blocks requested, 0 free and 1 evictable"):
        pool.device.allocate(2)
    assert sink.take() == [] and len(pool.device) == 3
    last = pool.device.slot_of(seq[2])
    assert pool.device.allocate(2, partial=True) == [last]
    assert sink.take() == [SourceRemoved(G1, 0, (seq[2],))]
    with pytest.raises(BlockPinnedError):
        pool.device.remove([seq[0]])
    with pytest.raises(UnknownBlockError):
        pool.device.unpin([seq[0], seq[0]])  # pinned once only
    assert pool.device.info(seq[0]).pins == 1  # the failed unpin changed nothing


def test_partial_allocation_and_free(make_pool):
    pool = make_pool(device=3, disk=None)
    slots = pool.device.allocate(5, partial=True)
    assert slots == [0, 1, 2] and pool.device.allocate(1, partial=True) == []
    pool.device.free(slots[:2])
    with pytest.raises(UnknownBlockError):
        pool.device.free([slots[0]])  # already free
    assert pool.device.allocate(2) == [0, 1]


def test_remove_emits_and_frees(make_pool, sink):
    pool = make_pool(disk=None)
    local, seq = chain(2)
    put(pool, local, seq)
    sink.take()
    with pytest.raises(UnknownBlockError):
        pool.device.remove([seq[0], 999])
    assert len(pool.device) == 2
    pool.device.remove(seq)
    assert sink.take() == [SourceRemoved(G1, 0, tuple(seq))]
    assert pool.device.free_blocks == 8


def test_write_block_rejects_wrong_size_or_dtype(make_pool, sink):
    pool = make_pool(disk=None)
    slot = pool.device.allocate(1)[0]
    with pytest.raises(LayoutError, match="dtype"):
        pool.write_block(slot, torch.zeros(SMALL.block_shape, dtype=torch.float32))
    with pytest.raises(LayoutError, match="shape"):
        pool.write_block(slot, torch.zeros((2, 2, 4, 2, 4), dtype=SMALL.dtype))
    local, seq = chain(1)
    registered = put(pool, local, seq)
    with pytest.raises(UnknownBlockError, match="not allocated"):
        pool.write_block(registered[0], block_content(SMALL, 1))
    assert checksum(pool.read_block(G1, seq[0])) == expected(seq[0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"device": 0}, "device"),
        ({"host": 0}, "host"),
        ({"disk": 0}, "disk"),
        ({"host": "100B"}, "holds no block"),
        ({"host": "lots"}, "not a byte size"),
    ],
)
def test_bad_capacities_are_refused(make_pool, kwargs, message):
    with pytest.raises(PoolConfigError, match=message):
        make_pool(**kwargs)


def test_capacity_in_bytes():
    assert capacity_blocks("2KiB", SMALL, "x") == 4
    assert capacity_blocks("1.5 kb", SMALL, "x") == 2


def test_bad_layout():
    with pytest.raises(LayoutError):
        BlockLayout(0, 4, 2, 8)
    with pytest.raises(LayoutError):
        BlockLayout(2, 4, 2, 8, dtype="float16")  # type: ignore[arg-type]


def test_disk_path_that_cannot_be_written(tmp_path, sink):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    options = PoolOptions(host_capacity=4, disk_capacity=4, disk_path=blocker / "g3.blocks")
    with pytest.raises(DiskTierError, match="cannot create the G3 block file"):
        TieredBlockPool.create(SMALL, 4, options, sink, device="cpu")
    huge = PoolOptions(host_capacity=4, disk_capacity="1000TB", disk_path=tmp_path / "g3.blocks")
    with pytest.raises(DiskTierError, match="cannot reserve"):
        TieredBlockPool.create(SMALL, 4, huge, sink, device="cpu")
    assert not (tmp_path / "g3.blocks").exists()
    with pytest.raises(PoolConfigError, match="disk_path"):
        TieredBlockPool.create(SMALL, 4, PoolOptions(host_capacity=4, disk_capacity=4), sink, device="cpu")
    assert sink.events == []


def test_disk_blocks_round_trip_by_runs(tmp_path):
    disk = DiskBlocks(tmp_path / "d.blocks", 8, 64)
    try:
        rows = [bytes([i]) * 64 for i in range(5)]
        disk.write([6, 0, 1, 2, 7], [memoryview(r) for r in rows])
        out = [bytearray(64) for _ in range(5)]
        disk.read([0, 1, 2, 6, 7], [memoryview(b) for b in out])
        assert [bytes(b) for b in out] == [rows[1], rows[2], rows[3], rows[0], rows[4]]
        with pytest.raises(DiskTierError, match="not one block"):
            disk.write([3], [memoryview(bytearray(10))])
    finally:
        disk.close()
    assert not (tmp_path / "d.blocks").exists()


def test_runs():
    assert runs([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]
    assert runs([]) == []


def test_adopted_layerwise_kv_cache(tmp_path, sink):
    kv = [torch.zeros((2, 6, 4, 2, 8), dtype=torch.bfloat16) for _ in range(2)]
    pool = TieredBlockPool.adopt(kv, PoolOptions(host_capacity=4), sink)
    assert pool.layout == SMALL and pool.device.capacity == 6
    local, seq = chain(2)
    slots = put(pool, local, seq)
    content = block_content(SMALL, seq[1])
    for layer in range(2):
        assert torch.equal(kv[layer][:, slots[1]].view(torch.uint8), content[layer].view(torch.uint8))
    assert checksum(pool.read_block(G1, seq[1])) == expected(seq[1])
    with pytest.raises(LayoutError, match="layer 1"):
        TieredBlockPool.adopt([kv[0], kv[1][:, :3]], PoolOptions(host_capacity=4), sink)
    with pytest.raises(LayoutError, match="2, num_blocks"):
        TieredBlockPool.adopt([torch.zeros(3, 4)], PoolOptions(host_capacity=4), sink)
