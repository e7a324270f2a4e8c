"""A deliberately simple model of the tier-index rules (DESIGN.md §4), for property tests.

Blocks are identified by their full path of tokens hashes from the root (no hashing, no
bitmasks, no aliases bookkeeping): a worker holds a position while one of its block
hashes maps to that path. Matching walks the prompt's prefixes one by one.
"""

from __future__ import annotations

from collections import Counter

from kvstream.events.model import LOWER_TIERS, Cleared, Removed, RouterEvent, Stored, Tier
from kvstream.router.index import (
    INVALID_STORE,
    PARENT_NOT_FOUND,
    UNKNOWN_REMOVE,
    TierOverlap,
    WorkerKey,
)

TIERS = (Tier.DEVICE, *LOWER_TIERS)
Path = tuple[int, ...]


class ReferenceIndex:
    def __init__(self) -> None:
        # (tier, worker key) → {block hash: path}
        self.blocks: dict[tuple[Tier, WorkerKey], dict[int, Path]] = {}
        self.known: set[WorkerKey] = set()
        self.counters: Counter[str] = Counter()

    def apply(self, ev: RouterEvent) -> None:
        key = WorkerKey(ev.worker_id, ev.dp_rank)
        self.known.add(key)
        if isinstance(ev, Cleared):
            # Scoped to the rank and tier that sent it (DESIGN §2).
            self.blocks.get((ev.tier, key), {}).clear()
            return
        held = self.blocks.setdefault((ev.tier, key), {})
        if isinstance(ev, Removed):
            for bh in ev.block_hashes:
                if bh in held:
                    del held[bh]
                else:
                    self.counters[UNKNOWN_REMOVE] += 1
            return
        assert isinstance(ev, Stored)
        hashes = list(ev.block_hashes)
        every = [*hashes, *ev.tokens_hashes, *([] if ev.parent_hash is None else [ev.parent_hash])]
        out_of_range = any(not 0 <= h < 2**64 for h in every)
        if out_of_range or len(set(hashes)) != len(hashes) or ev.parent_hash in hashes:
            self.counters[INVALID_STORE] += 1
            return
        if ev.parent_hash is None:
            path: Path = ()
        elif ev.parent_hash in held:
            path = held[ev.parent_hash]
        else:
            self.counters[PARENT_NOT_FOUND] += 1
            return
        for bh, th in zip(ev.block_hashes, ev.tokens_hashes):
            path = path + (th,)
            held[bh] = path

    def remove_worker(self, worker_id: int) -> None:
        self.known = {k for k in self.known if k.worker_id != worker_id}
        for tier, k in list(self.blocks):
            if k.worker_id == worker_id:
                del self.blocks[(tier, k)]

    def holds(self, tier: Tier, key: WorkerKey, path: Path) -> bool:
        return path in self.blocks.get((tier, key), {}).values()

    def tree_sizes(self) -> dict[WorkerKey, dict[Tier, int]]:
        return {k: {t: len(self.blocks.get((t, k), {})) for t in TIERS} for k in self.known}

    def find_matches_by_tier(self, local: list[int]) -> dict[WorkerKey, TierOverlap]:
        out = {}
        for key in self.known:
            counts = []
            pos = 0
            for tier in TIERS:
                start = pos
                while pos < len(local) and self.holds(tier, key, tuple(local[: pos + 1])):
                    pos += 1
                counts.append(pos - start)
            if any(counts):
                out[key] = TierOverlap(*counts)
        return out
