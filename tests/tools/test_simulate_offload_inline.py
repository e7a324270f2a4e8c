"""The offload engine's inline option (used by ``kvstream simulate``): the write-through
decisions of the threaded engine, taken synchronously on the registering thread."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvstream.events.model import Tier  # noqa: E402
from kvstream.hashing import block_hashes  # noqa: E402
from kvstream.worker.layout import BlockLayout  # noqa: E402
from kvstream.worker.offload import OffloadEngine, OffloadOptions  # noqa: E402
from kvstream.worker.pool import NewBlock, PoolOptions, TieredBlockPool  # noqa: E402
from kvstream.worker.source_events import SourceEvent, SourceStored  # noqa: E402
from tests.worker.counts import pinned  # noqa: E402

LAYOUT = BlockLayout(num_layers=1, block_size=2, kv_heads=1, head_dim=2, dtype=torch.float32)


class Sink:
    def __init__(self) -> None:
        self.events: list[SourceEvent] = []

    def on_source_event(self, event: SourceEvent) -> None:
        self.events.append(event)


def _pool(tmp_path: Path, sink: Sink, host: int = 8) -> TieredBlockPool:
    return TieredBlockPool.create(
        LAYOUT, 8, PoolOptions(host_capacity=host, disk_capacity=8, disk_path=tmp_path / "g3", pin_host=False),
        sink, device="cpu",
    )


def _put(pool: TieredBlockPool, n: int, first_token: int = 0) -> list[int]:
    local, seq = block_hashes(list(range(first_token, first_token + 16 * n)), 16)
    slots = pool.device.allocate(n)
    for k, slot in enumerate(slots):
        pool.write_block(slot, torch.full(LAYOUT.block_shape, float(k + 1)))
    pool.device.register(
        [NewBlock(s, seq[i], seq[i - 1] if i else None, local[i]) for i, s in enumerate(slots)], pin=False
    )
    return seq


def test_inline_offload_copies_before_register_returns(tmp_path: Path) -> None:
    sink = Sink()
    pool = _pool(tmp_path, sink)
    before = threading.active_count()
    engine = OffloadEngine(pool, OffloadOptions(inline=True, batch_blocks=2, disk_min_seen=2))
    assert threading.active_count() == before  # no copy threads
    seq = _put(pool, 3)
    # Already on G2, with the same bytes, and reported as one G2 store of the chain.
    assert all(h in pool.host for h in seq)
    assert [pool.read_block(Tier.HOST_PINNED, h) for h in seq] == [pool.read_block(Tier.DEVICE, h) for h in seq]
    g2 = [e for e in sink.events if isinstance(e, SourceStored) and e.source is Tier.HOST_PINNED]
    assert [h for e in g2 for h in e.block_hashes] == seq
    assert len(pool.disk) == 0  # seen once: not yet on disk
    pool.device.pin(seq, hit=True)  # a second sighting passes the disk filter
    assert all(h in pool.disk for h in seq)
    pool.device.unpin(seq)
    stats = engine.stats()
    assert (stats.written_host, stats.written_disk, stats.cancelled) == (3, 3, 0)
    assert pinned(pool, pool.device) == 0 and pinned(pool, pool.host) == 0
    assert engine.close().drained
    pool.close()


def test_inline_offload_evicts_host_like_the_threads(tmp_path: Path) -> None:
    sink = Sink()
    pool = _pool(tmp_path, sink, host=4)
    engine = OffloadEngine(pool, OffloadOptions(inline=True))
    first = _put(pool, 3)
    second = _put(pool, 3, first_token=10_000)
    # G2 keeps 4 blocks: the newest chain, and the root of the older one (tails go first).
    assert set(pool.host.hashes()) == set(second) | {first[0]}
    engine.close()
    pool.close()


def test_inline_is_not_a_count_option() -> None:
    assert OffloadOptions(inline=False).inline is False  # other fields stay validated
    with pytest.raises(Exception, match="batch_blocks"):
        OffloadOptions(inline=True, batch_blocks=0)
