"""A tier's pinned and allocated blocks, for the tests' assertions: from its public counts,
read under the pool's lock so that they are one view while an offload engine runs.

Every slot of a tier is free, allocated (filled, not yet registered) or held by a block;
a held block is pinned unless it is evictable."""

from __future__ import annotations

from kvstream.worker.pool import BlockTier, TieredBlockPool


def pinned(pool: TieredBlockPool, tier: BlockTier) -> int:
    with pool.locked():
        return len(tier) - tier.evictable_blocks


def allocated(pool: TieredBlockPool, tier: BlockTier) -> int:
    with pool.locked():
        return tier.capacity - tier.free_blocks - len(tier)
