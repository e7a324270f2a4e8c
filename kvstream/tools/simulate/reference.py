"""Reference hit rates for a workload, independent of routing: one LRU cache of a given
capacity fed every request in arrival order (what a fleet could reach if it were one
cache), measured the way the simulated engines measure hits (the leading blocks of the
prompt that the cache holds)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvstream.hashing import block_hashes
from kvstream.tools.simulate.errors import SimulationError
from kvstream.tools.simulate.trace import Request


@dataclass(frozen=True, slots=True)
class ReferenceHits:
    """Per request, in arrival order: prompt blocks, and those the LRU cache held."""

    capacity_blocks: int
    blocks: tuple[int, ...]
    hits: tuple[int, ...]

    def rate(self, start: int = 0, end: int | None = None) -> float:
        total = sum(self.blocks[start:end])
        return sum(self.hits[start:end]) / total if total else 0.0


def lru_reference(requests: Sequence[Request], block_size: int, capacity_blocks: int) -> ReferenceHits:
    """Feed ``requests`` in order to one LRU cache of ``capacity_blocks`` blocks."""
    if capacity_blocks <= 0:
        raise SimulationError(f"the reference cache needs a positive capacity, got {capacity_blocks}")
    cache: OrderedDict[int, None] = OrderedDict()
    blocks: list[int] = []
    hits: list[int] = []
    for req in requests:
        _, seqs = block_hashes(req.tokens(), block_size)
        n = 0
        while n < len(seqs) and seqs[n] in cache:
            n += 1
        blocks.append(len(seqs))
        hits.append(n)
        # Leaf first, so the root ends up the most recent: a chain is evicted from its tail.
        for h in reversed(seqs):
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return ReferenceHits(capacity_blocks, tuple(blocks), tuple(hits))
