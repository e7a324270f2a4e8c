"""Tier indexes (DESIGN.md §4): which worker holds which prompt prefix, on which tier.

The rules live in the compiled core (``kvstream._native.IndexCore``, Rust,
kvstream/_native_src/src/index.rs): a block's position is its chained sequence hash,
computed from the parent's when the block is stored (the workers' block hashes are
opaque and only find parents and removals); per tier, a map from position to the
bitmask of the worker slots holding it, and per slot a reverse map from block hash to
position, so that removing a block or a worker costs O(its blocks). Matching walks the
prompt's sequence hashes once for all workers and all tiers (one lookup per position:
an entry holds every tier's mask) and stops when no worker extends its prefix. A pure-Python version of the same design (dicts of int bitmasks,
prefix ANDs in C via ``itertools``) matched 4-5x slower in ``kvstream bench index``: a
Python dict lookup of a random 64-bit key costs ~150 ns at a million entries.

Beside the tiers, the core holds *expected* blocks (issue 33; expect.rs): positions of
prompts routed to a slot that it does not hold yet, which matching credits after the
stored tiers until the engine's events confirm them, the request that predicted them
fails, or their TTL runs out. They come from the load log (``kvstream.active``), not the
events log, so a worker known only by them (an engine without KV events, or whose events
stopped) is a candidate when named, never a worker the index *knows*, and snapshots
leave them out.

This module names the slots (worker id, dp rank), dispatches events, keeps the counters
of rejected or skipped events, and exports/imports workers for snapshots.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

from kvstream._native import IndexCore, WorkerTables
from kvstream.events.model import LOWER_TIERS, Cleared, Removed, RouterEvent, Stored, Tier

#: Counter reasons (``TieredIndex.counters``): events or blocks rejected or skipped.
PARENT_NOT_FOUND = "stored_parent_not_found"  # stored events rejected whole
INVALID_STORE = "stored_invalid"  # stored events rejected whole (self-referencing, bad hash)
UNKNOWN_REMOVE = "removed_unknown_block"  # block hashes of removed events skipped
REASONS: tuple[str, ...] = (PARENT_NOT_FOUND, INVALID_STORE, UNKNOWN_REMOVE)
#: IndexCore.store's outcome codes → reasons (0 is stored).
_STORE_OUTCOME: tuple[str | None, ...] = (None, INVALID_STORE, PARENT_NOT_FOUND)

#: Tiers in matching order; the core addresses them by position in this tuple.
TIERS: tuple[Tier, ...] = (Tier.DEVICE, *LOWER_TIERS)
_TIER_INDEX: dict[Tier, int] = {t: i for i, t in enumerate(TIERS)}
_U64 = 1 << 64


class WorkerKey(NamedTuple):
    """A routing candidate: one data-parallel rank of one worker."""

    worker_id: int
    dp_rank: int


class WorkerBlocks(NamedTuple):
    """One worker rank's blocks on one tier, as snapshots store them."""

    dp_rank: int
    tier: Tier
    block_hashes: Sequence[int]
    seq_hashes: Sequence[int]


class TierOverlap(NamedTuple):
    """Leading prompt blocks credited to one worker on each tier (DESIGN.md §4): the
    device prefix, then its continuation on host_pinned, disk and external in turn, then
    on the blocks it is expected to store (routed there, not confirmed yet)."""

    device: int = 0
    host_pinned: int = 0
    disk: int = 0
    external: int = 0
    expected: int = 0

    @property
    def stored(self) -> int:
        """Leading blocks the worker holds (every tier, not the expected ones)."""
        return self.device + self.host_pinned + self.disk + self.external


#: Expected blocks live this long unconfirmed (s), and at most this many per worker rank
#: unless its registration gives its device capacity (Dynamo's approximate indexer keeps
#: routed blocks 120 s).
DEFAULT_EXPECTED_TTL_S = 120.0
DEFAULT_EXPECTED_BLOCKS = 65_536


class TieredIndex:
    """The index of every tier, the workers known to it, and the counters of rejected
    or skipped events. Not thread-safe: one writer (the consume loop)."""

    def __init__(
        self, expected_ttl_s: float = DEFAULT_EXPECTED_TTL_S, expected_blocks: int = DEFAULT_EXPECTED_BLOCKS
    ) -> None:
        self._core = IndexCore(expected_ttl_s, expected_blocks)
        #: Slots of the worker ranks known by their events.
        self._slot_of: dict[tuple[int, int], int] = {}
        #: Slots of the ranks known only as candidates (expected blocks, no event).
        self._named: dict[tuple[int, int], int] = {}
        self._keys: list[WorkerKey | None] = []
        #: ``_keys`` with the named-only slots left out (None: to be rebuilt).
        self._indexed_keys: list[WorkerKey | None] | None = []
        self._free_slots: list[int] = []
        self._ranks: dict[int, set[int]] = {}
        #: The most blocks a rank may be expected to hold, where its capacity is known.
        self._caps: dict[tuple[int, int], int] = {}
        self.counters: Counter[str] = Counter({r: 0 for r in REASONS})

    # -- workers ---------------------------------------------------------------------

    def _slot(self, worker_id: int, dp_rank: int) -> int:
        """The slot of a rank its events name: it becomes known."""
        slot = self._slot_of.get((worker_id, dp_rank))
        if slot is None:
            slot = self._named.pop((worker_id, dp_rank), None)
            if slot is None:
                slot = self._new_slot(worker_id, dp_rank)
            self._slot_of[(worker_id, dp_rank)] = slot
            self._ranks.setdefault(worker_id, set()).add(dp_rank)
            self._indexed_keys = None
        return slot

    def _new_slot(self, worker_id: int, dp_rank: int) -> int:
        # Reusing the lowest free slot keeps the slot groups (64 slots each) few; a
        # freed slot has no block nor expectation left, so reuse is safe.
        if self._free_slots:
            self._free_slots.sort(reverse=True)
            slot = self._free_slots.pop()
            self._keys[slot] = WorkerKey(worker_id, dp_rank)
        else:
            slot = len(self._keys)
            self._keys.append(WorkerKey(worker_id, dp_rank))
        self._core.add_slot(slot)
        self._core.set_expected_cap(slot, self._caps.get((worker_id, dp_rank)))  # a reused slot's too
        self._indexed_keys = None
        return slot

    def _slot_for(self, key: tuple[int, int]) -> int:
        """The slot of a rank, known or named; a new named one if it has none."""
        slot = self._slot_of.get(key)
        if slot is None:
            slot = self._named.get(key)
            if slot is None:
                slot = self._named[key] = self._new_slot(*key)
        return slot

    def _free(self, slot: int) -> None:
        self._core.remove_slot(slot)
        self._keys[slot] = None
        self._free_slots.append(slot)
        self._indexed_keys = None

    @property
    def core(self) -> IndexCore:
        """The compiled index, for the decision's one call (kvstream.router.core)."""
        return self._core

    def workers(self) -> list[WorkerKey]:
        """Every (worker, dp_rank) that has published anything, in slot order."""
        return [k for k in self.candidate_slots(None) if k is not None]

    def candidate_slots(self, wanted: Sequence[WorkerKey] | None) -> list[WorkerKey | None]:
        """Per slot, its key when it is a candidate for ``wanted`` (else None): every
        rank of the wanted workers that the index knows, and the wanted keys, which get
        a slot if they have none (a worker that published nothing competes with no
        overlap; what is routed to it is expected there). None: every rank the index
        knows by its events (the list is the index's own: read it, never change it)."""
        if wanted is None:
            if self._indexed_keys is None:
                known = self._slot_of
                self._indexed_keys = [k if k is not None and k in known else None for k in self._keys]
            return self._indexed_keys
        keys = {(k[0], k[1]) for k in wanted}
        for k in keys:
            self._slot_for(k)
        ids = {k[0] for k in keys}
        named = self._named
        return [
            k if k is not None and k.worker_id in ids and (k not in named or k in keys) else None
            for k in self._keys
        ]

    def knows(self, worker_id: int) -> bool:
        return worker_id in self._ranks

    def keys_of(self, worker_id: int) -> list[WorkerKey]:
        """Every rank the index knows of a worker (none when it knows none)."""
        return [WorkerKey(worker_id, r) for r in sorted(self._ranks.get(worker_id, ()))]

    def remove_worker(self, worker_id: int, demote_at: float | None = None) -> list[WorkerKey]:
        """Forget a worker's blocks (every rank, every tier): O(its blocks); returns the
        keys removed. What it is expected to store stays until it expires (the load
        log's, not the events'): a worker still named as a candidate is routed by it.
        ``demote_at``: its events stopped, and its device blocks become expected there
        as of that time (the last the index knew of it: approximate mode)."""
        removed = []
        for rank in sorted(self._ranks.pop(worker_id, ())):
            key = WorkerKey(worker_id, rank)
            slot = self._slot_of.pop(key)
            if demote_at is not None:
                self._core.demote(slot, demote_at)
            if self._core.expected_count(slot):
                self._core.drop_blocks(slot)
                self._named[key] = slot
                self._indexed_keys = None
            else:
                self._free(slot)
            removed.append(key)
        return removed

    def forget(self, worker_id: int) -> None:
        """Drop what a worker the index does not know is expected to store (every rank):
        it left the fleet."""
        for key in [k for k in self._named if k[0] == worker_id]:
            self._free(self._named.pop(key))
        for key in [k for k in self._caps if k[0] == worker_id]:
            del self._caps[key]

    # -- expected blocks ----------------------------------------------------------------

    def expect(self, key: WorkerKey, sequence_hashes: Sequence[int] | bytes, routed_at: float) -> None:
        """A prompt (its blocks' sequence hashes, or them packed as little-endian u64)
        was routed to ``key`` at ``routed_at``: the blocks past the prefix it holds are
        expected there."""
        hashes = sequence_hashes if type(sequence_hashes) is bytes else list(sequence_hashes)
        self._core.expect(self._slot_for((key[0], key[1])), hashes, routed_at)

    def unexpect(self, key: WorkerKey, sequence_hashes: Sequence[int] | bytes) -> None:
        """These blocks are no longer expected on ``key`` (their request failed)."""
        slot = self._slot_of.get((key[0], key[1]), self._named.get((key[0], key[1])))
        if slot is not None:
            hashes = sequence_hashes if type(sequence_hashes) is bytes else list(sequence_hashes)
            self._core.unexpect(slot, hashes)

    def expire_expected(self, now: float) -> None:
        """Drop the expectations older than their TTL at ``now``."""
        self._core.expire_expected(now)

    def release_idle(self) -> None:
        """Free the slots of ranks known only as candidates that are expected to hold
        nothing (slots are candidates' order: freed only here, periodically)."""
        count = self._core.expected_count
        for key in [k for k, slot in self._named.items() if not count(slot)]:
            self._free(self._named.pop(key))

    def set_expected_capacity(self, key: WorkerKey, blocks: int | None) -> None:
        """The most blocks ``key`` may be expected to hold (its device capacity; None:
        the default): the oldest go first past it."""
        k = (key[0], key[1])
        if blocks is None:
            self._caps.pop(k, None)
        else:
            self._caps[k] = blocks
        slot = self._slot_of.get(k, self._named.get(k))
        if slot is not None:
            self._core.set_expected_cap(slot, blocks)

    def expected_counts(self) -> dict[WorkerKey, int]:
        """Blocks expected per worker rank (ranks with none left out)."""
        count = self._core.expected_count
        return {WorkerKey(*k): n for k, slot in (*self._slot_of.items(), *self._named.items()) if (n := count(slot))}

    def expected_total(self) -> int:
        return self._core.expected_total()

    def worker_blocks(self, worker_id: int) -> int:
        """Blocks a worker holds over every rank and tier: O(its ranks)."""
        size, slot_of = self._core.slot_size, self._slot_of
        total = 0
        for rank in self._ranks.get(worker_id, ()):
            total += size(slot_of[(worker_id, rank)])
        return total

    def clear_worker(self, worker_id: int) -> None:
        """Drop every block of every rank of a worker, on every tier, and what it was
        expected to store (a new incarnation holds nothing); it stays known."""
        for rank in self._ranks.get(worker_id, ()):
            self._core.clear_slot(self._slot_of[(worker_id, rank)])
        for key, slot in self._named.items():
            if key[0] == worker_id:
                self._core.clear_slot(slot)

    def _parts(self, worker_id: int) -> list[tuple[int, int, int]]:
        """(rank, tier index, slot) of each part a worker is exported as: every tier
        holding blocks, per rank (a rank with no block: its empty device tier, so that
        it stays known)."""
        out = []
        for rank in sorted(self._ranks.get(worker_id, ())):
            slot = self._slot_of[(worker_id, rank)]
            tiers = [i for i in range(len(TIERS)) if self._core.size(i, slot)]
            out.extend((rank, i, slot) for i in tiers or [0])
        return out

    def export_worker(self, worker_id: int) -> list[WorkerBlocks]:
        """Every block of a worker, per rank and tier (as lists). O(its blocks)."""
        return [WorkerBlocks(rank, TIERS[i], *self._core.export(i, slot)) for rank, i, slot in self._parts(worker_id)]

    def export_tables(self, worker_id: int) -> bytes:
        """A worker's reverse tables as raw arrays (a snapshot blob's body, read back by
        ``WorkerTables.parse``). O(its blocks), copies only."""
        return self._core.export_tables(self._parts(worker_id))

    def import_worker(self, worker_id: int, parts: WorkerTables | Iterable[WorkerBlocks]) -> None:
        """Install a worker exported by :meth:`export_tables` or :meth:`export_worker`
        (it must be unknown)."""
        if not isinstance(parts, WorkerTables):
            try:
                parts = WorkerTables.from_lists(
                    [(p.dp_rank, _TIER_INDEX[p.tier], p.block_hashes, p.seq_hashes) for p in parts]
                )
            except (OverflowError, TypeError):
                raise ValueError("exported hashes must be integers in [0, 2**64)") from None
        self.import_workers({worker_id: parts})

    def import_workers(self, workers: Mapping[int, WorkerTables]) -> None:
        """Install unknown workers' tables in one step (a restore): the tables are moved
        in as they are and the positions' owners built once for all of them."""
        for wid in workers:
            if wid in self._ranks:
                raise ValueError(f"worker {wid} is already known")
        self._core.install(
            [(tables, [self._slot(wid, rank) for rank, _ in tables.keys()]) for wid, tables in workers.items()]
        )

    # -- events ----------------------------------------------------------------------

    def apply(self, event: RouterEvent) -> str | None:
        """Apply one router event; returns the counter reason when it was rejected
        whole (a stored event), else None. Unknown removes are skipped and counted."""
        slot = self._slot(event.worker_id, event.dp_rank)
        kind = type(event)
        if kind is Stored:
            try:
                outcome = self._core.store(
                    _TIER_INDEX[event.tier],
                    slot,
                    event.parent_hash,
                    event.block_hashes,
                    event.tokens_hashes,
                )
            except (OverflowError, TypeError):  # a hash outside [0, 2**64)
                outcome = 1
            reason = _STORE_OUTCOME[outcome]
            if reason is not None:
                self.counters[reason] += 1
            return reason
        if kind is Removed:
            tier = _TIER_INDEX[event.tier]
            try:
                unknown = self._core.remove(tier, slot, event.block_hashes)
            except (OverflowError, TypeError):  # hashes outside [0, 2**64) are not held
                valid = [h for h in event.block_hashes if 0 <= h < _U64]
                unknown = len(event.block_hashes) - len(valid)
                unknown += self._core.remove(tier, slot, valid)
            if unknown:
                self.counters[UNKNOWN_REMOVE] += unknown
            return None
        if kind is Cleared:
            # Scoped to the rank that sent it and to its tier (DESIGN §2): an engine's
            # reset clears what that engine really dropped; a new epoch (the fold's
            # business) is what wipes every rank.
            self._core.clear_tier(_TIER_INDEX[event.tier], slot)
            return None
        raise TypeError(f"not a router event: {event!r}")

    def apply_packed(
        self,
        kind: type[RouterEvent],
        worker_id: int,
        dp_rank: int,
        tier: Tier,
        parent_hash: int | None,
        data: bytes,
        blocks_at: int,
        tokens_at: int,
        count: int,
    ) -> str | None:
        """:meth:`apply` of an event whose hashes are still packed in a message:
        ``count`` little-endian u64 block hashes at byte ``blocks_at`` of ``data`` (and
        as many tokens hashes at ``tokens_at`` for a stored event)."""
        slot = self._slot(worker_id, dp_rank)
        if kind is Stored:
            outcome = self._core.store_packed(_TIER_INDEX[tier], slot, parent_hash, data, blocks_at, tokens_at, count)
            reason = _STORE_OUTCOME[outcome]
            if reason is not None:
                self.counters[reason] += 1
            return reason
        if kind is Removed:
            unknown = self._core.remove_packed(_TIER_INDEX[tier], slot, data, blocks_at, count)
            if unknown:
                self.counters[UNKNOWN_REMOVE] += unknown
            return None
        if kind is Cleared:
            self._core.clear_tier(_TIER_INDEX[tier], slot)
            return None
        raise TypeError(f"not a router event kind: {kind!r}")

    # -- queries ---------------------------------------------------------------------

    def tree_sizes(self) -> dict[WorkerKey, dict[Tier, int]]:
        """Blocks (block hashes) held per known worker per tier."""
        size = self._core.size
        return {
            key: {t: size(i, self._slot_of[key]) for i, t in enumerate(TIERS)}
            for key in self.workers()
        }

    def blocks(self, key: WorkerKey, tier: Tier) -> Mapping[int, int]:
        """A worker's blocks on a tier: block hash → sequence hash (a read-only copy)."""
        slot = self._slot_of.get((key[0], key[1]))
        if slot is None:
            return MappingProxyType({})
        return MappingProxyType(dict(zip(*self._core.export(_TIER_INDEX[tier], slot))))

    def heap_bytes(self) -> int:
        """Approximate bytes held by the core's hash tables."""
        return self._core.heap_bytes()

    def find_matches_by_tier(
        self, local_hashes: Sequence[int], seq_hashes: Sequence[int] | None = None
    ) -> dict[WorkerKey, TierOverlap]:
        """Per worker with any match, the prompt's leading blocks credited on each tier.

        ``seq_hashes``, when given, are the chained sequence hashes of ``local_hashes``
        (as ``kvstream.hashing.block_hashes`` returns them); else the core chains the
        local hashes itself, only as far as some worker matches. Hashes must be ints in
        [0, 2**64) (else OverflowError).
        """
        if seq_hashes is None:
            hashes, chained = local_hashes, False  # the core chains them as it walks
        elif len(local_hashes) != len(seq_hashes):
            raise ValueError(
                f"{len(local_hashes)} local hashes but {len(seq_hashes)} sequence hashes"
            )
        else:
            hashes, chained = seq_hashes, True
        if type(hashes) is not list:  # the core reads a list, lazily
            hashes = list(hashes)
        keys = self._keys
        new = tuple.__new__  # TierOverlap(*counts) costs ~4x more per matched worker
        return {
            keys[slot]: new(TierOverlap, counts)  # type: ignore[misc]
            for slot, counts in self._core.find_matches(hashes, chained)
        }
