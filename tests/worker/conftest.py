"""Fixtures of the tiered pool tests: a small layout, a recording sink, a pool factory."""

from __future__ import annotations

import hashlib
import importlib.util
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstream.events.model import Tier
from kvstream.worker.source_events import SourceEvent, SourceRemoved, SourceStored


class RecordingSink:
    """A sink that keeps every source event, in order (thread-safe)."""

    def __init__(self) -> None:
        self.events: list[SourceEvent] = []
        self._taken = 0
        self._lock = threading.Lock()

    def on_source_event(self, event: SourceEvent) -> None:
        with self._lock:
            self.events.append(event)

    def take(self) -> list[SourceEvent]:
        """Events since the previous ``take`` (``events`` keeps them all)."""
        with self._lock:
            out = self.events[self._taken :]
            self._taken = len(self.events)
            return out

    def held(self) -> dict[Tier, set[int]]:
        """Blocks per tier according to the events so far (stores minus removes)."""
        out: dict[Tier, set[int]] = {t: set() for t in Tier}
        with self._lock:
            for ev in self.events:
                if isinstance(ev, SourceStored):
                    assert not out[ev.source] & set(ev.block_hashes), "stored twice without a remove"
                    out[ev.source].update(ev.block_hashes)
                elif isinstance(ev, SourceRemoved):
                    assert set(ev.block_hashes) <= out[ev.source], "removed a block never stored"
                    out[ev.source].difference_update(ev.block_hashes)
        return out


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()


# The pool needs torch (the `worker` extra); without it the rest of tests/worker still runs.
HAVE_TORCH = importlib.util.find_spec("torch") is not None
collect_ignore_glob = [] if HAVE_TORCH else ["test_pool*.py", "test_offload*.py", "test_onboard*.py", "test_synthetic*.py"]

if HAVE_TORCH:
    import torch

    from kvstream.hashing import block_hashes
    from kvstream.worker.layout import BlockLayout
    from kvstream.worker.pool import NewBlock, PoolOptions, TieredBlockPool
    from kvstream.worker.synthetic import block_content

    #: 2 layers × (K,V) × 4 tokens × 2 heads × 8 dims of bf16 = 512 bytes a block.
    SMALL = BlockLayout(num_layers=2, block_size=4, kv_heads=2, head_dim=8, dtype=torch.bfloat16)

    requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)")

    def checksum(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    def expected(block_hash: int, layout: BlockLayout = SMALL) -> str:
        """Checksum of the synthetic content of a block."""
        return checksum(block_content(layout, block_hash).view(torch.uint8).numpy().tobytes())

    def chain(n: int, start: int = 0, block_size: int = SMALL.block_size) -> tuple[list[int], list[int]]:
        """(local, sequence) hashes of ``n`` blocks of tokens ``start, start+1, ...``."""
        return block_hashes(list(range(start, start + n * block_size)), block_size)

    def put(pool: TieredBlockPool, local: list[int], seq: list[int], first: int = 0, priority: int = 0, pin: bool = False) -> list[int]:
        """Fill and register blocks ``first..`` of a chain on G1 with their synthetic content."""
        slots = pool.device.allocate(len(seq) - first)
        for slot, i in zip(slots, range(first, len(seq))):
            pool.write_block(slot, block_content(pool.layout, seq[i]))
        return pool.device.register(
            [NewBlock(s, seq[i], seq[i - 1] if i else None, local[i]) for s, i in zip(slots, range(first, len(seq)))],
            priority=priority,
            pin=pin,
        )

    @pytest.fixture
    def make_pool(tmp_path: Path, sink: RecordingSink) -> Iterator[Callable[..., TieredBlockPool]]:
        """``make_pool(device=8, host=8, disk=8, layout=SMALL, device_type="cpu")``; disk=None: no G3."""
        pools: list[TieredBlockPool] = []

        def make(
            device: int | str = 8,
            host: int | str = 8,
            disk: int | str | None = 8,
            layout: BlockLayout = SMALL,
            device_type: str = "cpu",
        ) -> TieredBlockPool:
            options = PoolOptions(
                host_capacity=host,
                disk_capacity=disk,
                disk_path=tmp_path / f"g3-{len(pools)}.blocks" if disk is not None else None,
            )
            pool = TieredBlockPool.create(layout, device, options, sink, device=device_type)
            pools.append(pool)
            return pool

        yield make
        for pool in pools:
            pool.close()
