"""The G1 KV cache with vLLM v1's prefix caching (its ``BlockPool``'s semantics).

Blocks hold ``block_size`` tokens. A full block is cached under a hash chained from its
parent's (vLLM hashes ``(parent, tokens, extra keys)``; here SHA-256 of the same, kept as
its last 8 bytes as vLLM's ``maybe_convert_block_hash`` publishes it). A request's blocks
are referenced while it runs; a block nobody references is free but stays cached until it
is reused, least recently freed first (a request frees its blocks tail first, so a
prefix outlives its continuations). Storing a block and reusing a free cached block are
the KV events (``BlockStored``, ``BlockRemoved``), recorded in order for the publisher.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstream.emulator.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
)

_NONE_HASH = b"\0" * 8


def block_hash(parent: int | None, tokens: Sequence[int], extra: tuple[Any, ...] | None = None) -> int:
    """The 64-bit hash of a full block: its parent's hash, its tokens, its extra keys."""
    h = hashlib.sha256(_NONE_HASH if parent is None else parent.to_bytes(8, "big"))
    h.update(np.asarray(tokens, dtype="<u4").tobytes())
    if extra:
        h.update(repr(extra).encode())
    return int.from_bytes(h.digest()[-8:], "big")


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens; ``events`` collects what the engine
    publishes at the end of the step (vLLM's ``take_events``)."""

    def __init__(self, num_blocks: int, block_size: int, *, medium: str = "GPU") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.medium = medium
        self._refs = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        #: Free blocks, least recently freed first (dict order; O(1) removal by id).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        #: hash → the blocks cached under it (two requests may compute the same block:
        #: vLLM keeps both, and a lookup takes the first).
        self._cached: dict[int, dict[int, None]] = {}
        self.events: list[KvEvent] = []

    # -- queries ------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: the share of blocks referenced by requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def match(self, hashes: Sequence[int]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes``."""
        found: list[int] = []
        for h in hashes:
            blocks = self._cached.get(h)
            if blocks is None:
                break
            found.append(next(iter(blocks)))
        return found

    def can_take(self, hits: Sequence[int], new: int) -> bool:
        """``new`` fresh blocks can be allocated after referencing ``hits`` (a free hit
        leaves the free queue too)."""
        return new + sum(1 for b in hits if self._refs[b] == 0) <= len(self._free)

    # -- changes ------------------------------------------------------------------------
    def touch(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks from the free queue's head (evicting what they cached), or None
        when fewer are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                # vLLM announces each evicted block, even when another copy keeps the hash.
                self._hash[b] = None
                copies = self._cached[h]
                del copies[b]
                if not copies:
                    del self._cached[h]
                self.events.append(BlockRemoved([h], self.medium, group_idx=0))
            self._refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """A request lets go of its blocks; the tail is freed first (evicted first)."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None

    def cache(self, blocks: Sequence[int], hashes: Sequence[int], parent: int | None,
              tokens: Sequence[int], extra_keys: list[tuple[Any, ...] | None] | None) -> None:
        """Register newly full ``blocks`` under ``hashes`` and record one ``BlockStored``
        for them (``tokens``: their token ids; ``parent``: the hash before the first).
        A hash another block already caches gets a second copy, as in vLLM."""
        for b, h in zip(blocks, hashes, strict=True):
            self._cached.setdefault(h, {})[b] = None
            self._hash[b] = h
        self.events.append(BlockStored(list(hashes), parent, list(tokens), self.block_size, None, self.medium, None,
                                       extra_keys=extra_keys, group_idx=0))

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache``: forget every cached block, only when no request
        holds one (False otherwise)."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events


class HostTier:
    """vLLM's CPU offloading (``OffloadingConnector``, the native CPU backend, offloaded
    blocks of the GPU block size) behind G1: every block cached on G1 is also stored
    here; a prompt's continuation past its G1 hit is loaded from here instead of
    computed. Least recently stored or loaded blocks go first. Its events are vLLM's
    default (not self-describing) offload events: one ``BlockStored`` per block naming
    only its hash (no parent, no tokens, ``block_size`` 0, ``medium`` CPU), and one
    ``BlockRemoved`` per eviction batch; a consumer resolves them from the GPU events of
    the same hashes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.events: list[KvEvent] = []

    def match(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, are held."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._lru.move_to_end(h)

    def store(self, hashes: Sequence[int]) -> None:
        """Offload newly computed blocks, as vLLM's ``prepare_store``: those held already
        are skipped, room is made first by evicting from the LRU end (never a block of
        this batch), and what still does not fit is not stored."""
        batch = set(hashes)
        new = [h for h in dict.fromkeys(hashes) if h not in self._lru]
        need = len(self._lru) + len(new) - self.capacity
        evicted: list[int] = []
        if need > 0:
            for h in self._lru:
                if len(evicted) == need:
                    break
                if h not in batch:
                    evicted.append(h)
            for h in evicted:
                del self._lru[h]
            new = new[:self.capacity - len(self._lru)]
        if evicted:
            self.events.append(BlockRemoved(evicted, "CPU", group_idx=0))
        for h in new:
            self._lru[h] = None
            self.events.append(BlockStored([h], None, [], 0, None, "CPU", None, group_idx=0))

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events
