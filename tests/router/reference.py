"""A deliberately simple model of the tier-index rules (DESIGN.md §4), for property tests.

Blocks are identified by their full path of tokens hashes from the root (no hashing, no
bitmasks, no aliases bookkeeping): a worker holds a position while one of its block
hashes maps to that path. Matching walks the prompt's prefixes one by one.

Expected blocks (issue 33) are a dict per worker rank, path → (when routed, order):
added past the held prefix, confirmed (dropped) by a store of the path on any tier,
dropped by a device ``cleared``, by their request's refutation, by age (``now - t >
ttl``), and past the rank's capacity oldest first (of equal times, the deepest first).
"""

from __future__ import annotations

import itertools
from collections import Counter

from kvstream.events.model import LOWER_TIERS, Cleared, Removed, RouterEvent, Stored, Tier
from kvstream.hashing import sequence_hashes
from kvstream.router.index import (
    DEFAULT_EXPECTED_BLOCKS,
    DEFAULT_EXPECTED_TTL_S,
    INVALID_STORE,
    PARENT_NOT_FOUND,
    UNKNOWN_REMOVE,
    TierOverlap,
    WorkerKey,
)

TIERS = (Tier.DEVICE, *LOWER_TIERS)
Path = tuple[int, ...]


class ReferenceIndex:
    def __init__(self, expected_ttl_s: float = DEFAULT_EXPECTED_TTL_S, expected_cap: int = DEFAULT_EXPECTED_BLOCKS) -> None:
        # (tier, worker key) → {block hash: path}
        self.blocks: dict[tuple[Tier, WorkerKey], dict[int, Path]] = {}
        self.known: set[WorkerKey] = set()
        self.counters: Counter[str] = Counter()
        # worker key → {path: (routed at, order)}
        self.expected: dict[WorkerKey, dict[Path, tuple[float, int]]] = {}
        self.caps: dict[WorkerKey, int] = {}
        self.ttl, self.default_cap = expected_ttl_s, expected_cap
        self._order = itertools.count()

    def apply(self, ev: RouterEvent) -> None:
        key = WorkerKey(ev.worker_id, ev.dp_rank)
        self.known.add(key)
        if isinstance(ev, Cleared):
            # Scoped to the rank and tier that sent it (DESIGN §2).
            self.blocks.get((ev.tier, key), {}).clear()
            if ev.tier is Tier.DEVICE:
                self.expected.pop(key, None)
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
        expected = self.expected.get(key, {})
        for bh, th in zip(ev.block_hashes, ev.tokens_hashes):
            path = path + (th,)
            held[bh] = path
            expected.pop(path, None)

    def remove_worker(self, worker_id: int, demote_at: float | None = None) -> None:
        if demote_at is not None:
            # Its device blocks become expected as of demote_at (in sequence-hash order).
            for key in [k for k in self.known if k.worker_id == worker_id]:
                held = sorted(set(self.blocks.get((Tier.DEVICE, key), {}).values()), key=lambda p: sequence_hashes(list(p))[-1])
                exp = self.expected.setdefault(key, {})
                for path in reversed(held):
                    if path in exp and exp[path][0] >= demote_at:
                        continue
                    exp[path] = (demote_at, next(self._order))
                self._trim(key)
        self.known = {k for k in self.known if k.worker_id != worker_id}
        for tier, k in list(self.blocks):
            if k.worker_id == worker_id:
                del self.blocks[(tier, k)]

    def holds(self, tier: Tier, key: WorkerKey, path: Path) -> bool:
        return path in self.blocks.get((tier, key), {}).values()

    # -- expected blocks -------------------------------------------------------------------

    def expect(self, key: WorkerKey, local: list[int], t: float) -> None:
        counts = self._stored_counts(key, local)
        exp = self.expected.setdefault(key, {})
        for i in reversed(range(sum(counts), len(local))):
            path = tuple(local[: i + 1])
            if path in exp and exp[path][0] >= t:
                continue
            exp[path] = (t, next(self._order))
        self._trim(key)

    def unexpect(self, key: WorkerKey, local: list[int]) -> None:
        exp = self.expected.get(key, {})
        for i in range(len(local)):
            exp.pop(tuple(local[: i + 1]), None)

    def set_cap(self, key: WorkerKey, cap: int | None) -> None:
        if cap is None:
            self.caps.pop(key, None)
        else:
            self.caps[key] = cap
        self._trim(key)

    def _trim(self, key: WorkerKey) -> None:
        exp = self.expected.get(key, {})
        while len(exp) > self.caps.get(key, self.default_cap):
            del exp[min(exp, key=lambda p: exp[p])]

    def expire(self, now: float) -> None:
        for exp in self.expected.values():
            for path in [p for p, (t, _) in exp.items() if now - t > self.ttl]:
                del exp[path]

    def expected_counts(self) -> dict[WorkerKey, int]:
        return {k: len(e) for k, e in self.expected.items() if e}

    def tree_sizes(self) -> dict[WorkerKey, dict[Tier, int]]:
        return {k: {t: len(self.blocks.get((t, k), {})) for t in TIERS} for k in self.known}

    def _stored_counts(self, key: WorkerKey, local: list[int]) -> list[int]:
        counts = []
        pos = 0
        for tier in TIERS:
            start = pos
            while pos < len(local) and self.holds(tier, key, tuple(local[: pos + 1])):
                pos += 1
            counts.append(pos - start)
        return counts

    def find_matches_by_tier(self, local: list[int]) -> dict[WorkerKey, TierOverlap]:
        out = {}
        for key in self.known | {k for k, e in self.expected.items() if e}:
            counts = self._stored_counts(key, local)
            pos = start = sum(counts)
            exp = self.expected.get(key, {})
            while pos < len(local) and tuple(local[: pos + 1]) in exp:
                pos += 1
            counts.append(pos - start)
            if any(counts):
                out[key] = TierOverlap(*counts)
        return out
