"""The tiered block pool (DESIGN.md §8): G1 device, G2 host (pinned with CUDA), G3 disk.

Every tier names its blocks by router sequence hash. A slot is free, *allocated* (handed
to a writer, not yet visible) or *registered* (visible under its hash; pinned while in
use, evictable otherwise). Registering reports a ``SourceStored`` on the tier to the
sink, evicting a ``SourceRemoved``; eviction takes the lowest priority first, then the
least recently used, leaves before their parents. Recency is tier-wide: a hit on one
tier refreshes the block's copies on the others.

One re-entrant lock guards the metadata of all tiers (operations on it are dictionary
updates; copies run outside it), so multi-tier steps such as onboarding are atomic and
sink events leave in the order the tiers changed. The sink is called under that lock,
one event at a time (it need not be thread-safe, and must not call back into the pool). Listeners (the offload engine) are
called after the outermost lock is released, so that they may block (back-pressure)
without stalling the pool.
"""

from __future__ import annotations

import errno
import heapq
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from kvstream.events.model import Tier
from kvstream.worker.errors import (
    BlockPinnedError,
    DiskTierError,
    PoolConfigError,
    PoolExhaustedError,
    UnknownBlockError,
)
from kvstream.worker.layout import (
    BlockLayout,
    DeviceStorage,
    LayerwiseBlocks,
    TensorBlocks,
    capacity_blocks,
    runs,
)
from kvstream.worker.source_events import SourceEventSink, SourceRemoved, SourceStored

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def default_device() -> torch.device:
    """``cuda`` where a GPU is present, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True, slots=True)
class PoolOptions:
    """Capacities of the lower tiers (block counts, or byte sizes such as ``"4GiB"``)."""

    host_capacity: int | str
    #: None: no G3 tier.
    disk_capacity: int | str | None = None
    #: The G3 block file (one per worker, created and preallocated; removed on close).
    disk_path: str | os.PathLike[str] | None = None
    dp_rank: int = 0
    #: Pin G2 host memory; None: pin exactly when CUDA is present.
    pin_host: bool | None = None


@dataclass(frozen=True, slots=True)
class NewBlock:
    """A filled slot to register under ``block_hash`` (a sequence hash)."""

    slot: int
    block_hash: int
    parent_hash: int | None
    tokens_hash: int


@dataclass(frozen=True, slots=True)
class BlockInfo:
    block_hash: int
    slot: int
    parent_hash: int | None
    tokens_hash: int
    priority: int
    pins: int


@dataclass(slots=True)
class _Entry:
    slot: int
    parent_hash: int | None
    tokens_hash: int
    priority: int
    pins: int
    #: Blocks held on this tier whose parent this block is (eviction takes leaves first).
    children: int = 0


class PoolListener(Protocol):
    """Told about registrations and uses, outside the pool lock (may block)."""

    def on_registered(
        self, tier: Tier, blocks: tuple[int, ...], ready: torch.cuda.Event | None
    ) -> None:
        """``blocks`` were registered on ``tier``; on a GPU, their content is complete
        once ``ready`` (recorded on the registering thread's stream) has completed."""
        ...

    def on_hit(self, tier: Tier, blocks: tuple[int, ...]) -> None:
        """``blocks`` held on ``tier`` were reused by a request."""
        ...


class DiskBlocks:
    """G3: one preallocated file, block ``s`` at byte offset ``s × block_bytes``."""

    def __init__(self, path: str | os.PathLike[str], capacity: int, block_bytes: int) -> None:
        self.path = Path(path)
        self.capacity = capacity
        self.block_bytes = block_bytes
        try:
            # Truncate: the file is this pool's scratch space; its old bytes mean nothing
            # because the pool's index lives in memory.
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise DiskTierError(f"cannot create the G3 block file {self.path}: {exc.strerror}") from None
        size = capacity * block_bytes
        try:
            # Reserve the space now so that a full disk fails here, not in the middle of an offload.
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            if exc.errno != errno.EOPNOTSUPP:
                self._discard()
                raise DiskTierError(
                    f"cannot reserve {size} bytes for the G3 block file {self.path}: {exc.strerror}"
                ) from None
            os.ftruncate(self._fd, size)

    def _discard(self) -> None:
        os.close(self._fd)
        self.path.unlink(missing_ok=True)

    def write(self, slots: Sequence[int], rows: Sequence[memoryview]) -> None:
        """Write ``rows[i]`` (one block of bytes each) at block ``slots[i]``; one gathered
        write per run of consecutive slots."""
        for i, first, n in runs(slots):
            self._io(os.pwritev, rows[i : i + n], first * self.block_bytes, "write")

    def read(self, slots: Sequence[int], rows: Sequence[memoryview]) -> None:
        """Read block ``slots[i]`` into ``rows[i]``; one scattered read per run."""
        for i, first, n in runs(slots):
            self._io(os.preadv, rows[i : i + n], first * self.block_bytes, "read")

    def _io(self, call: Callable[[int, Sequence[memoryview], int], int], rows: Sequence[memoryview], offset: int, what: str) -> None:
        views = [memoryview(r).cast("B") for r in rows]
        for v in views:
            if v.nbytes != self.block_bytes:
                raise DiskTierError(f"a G3 {what} buffer of {v.nbytes} bytes is not one block")
        k = 0
        while k < len(views):
            try:
                done = call(self._fd, views[k : k + _IOV_MAX], offset)
            except OSError as exc:
                raise DiskTierError(f"G3 {what} at offset {offset} of {self.path} failed: {exc.strerror}") from None
            if done <= 0:
                raise DiskTierError(f"G3 {what} at offset {offset} of {self.path} made no progress")
            offset += done
            # A short transfer (large runs, signals) resumes inside the first unfinished buffer.
            while done > 0:
                if done >= views[k].nbytes:
                    done -= views[k].nbytes
                    k += 1
                else:
                    views[k] = views[k][done:]
                    done = 0

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            self._discard()
            self._fd = -1


class BlockTier:
    """Block metadata of one tier; every method takes the pool lock."""

    def __init__(self, pool: TieredBlockPool, tier: Tier, capacity: int) -> None:
        self._pool = pool
        self.tier = tier
        self.capacity = capacity
        self._entries: dict[int, _Entry] = {}
        # priority → unpinned registered hashes, least recently used first
        self._lru: dict[int, OrderedDict[int, None]] = {}
        self._evictable = 0
        self._free = list(range(capacity))  # a heap: low slots first keeps allocations contiguous
        self._allocated: set[int] = set()

    # -- queries -------------------------------------------------------------------------
    def __contains__(self, block_hash: object) -> bool:
        with self._pool.locked():
            return block_hash in self._entries

    def __len__(self) -> int:
        with self._pool.locked():
            return len(self._entries)

    def holds(self, block_hash: int) -> bool:
        """``block_hash in tier`` for a caller already holding the pool lock (the
        offload engine asks it for every block it considers)."""
        return block_hash in self._entries

    def hashes(self) -> list[int]:
        with self._pool.locked():
            return list(self._entries)

    @property
    def free_blocks(self) -> int:
        with self._pool.locked():
            return len(self._free)

    @property
    def evictable_blocks(self) -> int:
        with self._pool.locked():
            return self._evictable

    def info(self, block_hash: int) -> BlockInfo | None:
        with self._pool.locked():
            e = self._entries.get(block_hash)
            if e is None:
                return None
            return BlockInfo(block_hash, e.slot, e.parent_hash, e.tokens_hash, e.priority, e.pins)

    def match(self, block_hashes: Sequence[int], start: int = 0) -> int:
        """How many of ``block_hashes[start:]`` this tier holds, contiguously from ``start``."""
        with self._pool.locked():
            n = start
            while n < len(block_hashes) and block_hashes[n] in self._entries:
                n += 1
            return n - start

    # -- slots ---------------------------------------------------------------------------
    def allocate(self, n: int, partial: bool = False) -> list[int]:
        """``n`` free slots (fewer, possibly none, when ``partial``), evicting unpinned
        blocks as needed. Without ``partial``, too few slots raise before anything changes."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        with self._pool.locked():
            available = len(self._free) + self._evictable
            if n > available:
                if not partial:
                    raise PoolExhaustedError(
                        f"{self.tier.value} tier: {n} blocks requested, {len(self._free)} free "
                        f"and {self._evictable} evictable of {self.capacity} (the rest are pinned "
                        "or allocated)"
                    )
                n = available
            slots = [heapq.heappop(self._free) for _ in range(min(n, len(self._free)))]
            if len(slots) < n:
                slots.extend(self._evict(n - len(slots)))
            slots.sort()
            self._allocated.update(slots)
            return slots

    def free(self, slots: Sequence[int]) -> None:
        """Return allocated (never registered) slots."""
        with self._pool.locked():
            unknown = [s for s in slots if s not in self._allocated]
            if unknown or len(set(slots)) != len(slots):
                raise UnknownBlockError(f"{self.tier.value} tier: slots {unknown or list(slots)} are not allocated once each")
            for s in slots:
                self._allocated.discard(s)
                heapq.heappush(self._free, s)

    def _evict(self, n: int) -> list[int]:
        """Free ``n`` slots, least recently used first, but leaves before parents: a block
        whose children are still held goes back to the recent end (as a parent is used
        whenever a child is), so a chain is never cut above a block the tier keeps. Only
        when a whole round finds nothing but parents (their children pinned) does a parent
        go."""
        slots: list[int] = []
        removed: list[int] = []
        for priority in sorted(self._lru):
            queue = self._lru[priority]
            deferred = 0
            while queue and len(slots) < n:
                h, _ = queue.popitem(last=False)
                e = self._entries[h]
                if e.children and deferred < len(queue):
                    queue[h] = None
                    deferred += 1
                    continue
                deferred = 0
                del self._entries[h]
                self._orphan(e)
                slots.append(e.slot)
                removed.append(h)
            if not queue:
                del self._lru[priority]
            if len(slots) == n:
                break
        self._evictable -= len(removed)
        if removed:
            self._pool._emit(SourceRemoved(self.tier, self._pool.dp_rank, tuple(removed)))
        return slots

    def _orphan(self, e: _Entry) -> None:
        """``e`` left the tier: its parent has one child fewer here."""
        parent = self._entries.get(e.parent_hash) if e.parent_hash is not None else None
        if parent is not None:
            parent.children -= 1

    def touch(self, block_hashes: Sequence[int]) -> None:
        """Make the held, unpinned blocks among ``block_hashes`` the most recently used of
        their priority (a request used them on another tier). List a chain parent first:
        the parent ends up the most recent."""
        with self._pool.locked():
            entries = self._entries
            for h in reversed(block_hashes):
                e = entries.get(h)
                if e is not None and e.pins == 0:
                    self._lru[e.priority].move_to_end(h)

    # -- registration and pins -----------------------------------------------------------
    def register(self, blocks: Sequence[NewBlock], priority: int = 0, pin: bool = True) -> list[int]:
        """Make filled allocated slots visible under their hashes; returns the slot that
        holds each block. A hash the tier already holds keeps its existing slot (the new
        one is freed). Registered blocks are pinned for the caller when ``pin``.

        A block's parent must be held on this tier (or come earlier in ``blocks``): a
        consolidator or router computes a block's place from its parent on the same tier."""
        with self._pool.locked():
            bad = [b.slot for b in blocks if b.slot not in self._allocated]
            if bad or len({b.slot for b in blocks}) != len(blocks):
                raise UnknownBlockError(
                    f"{self.tier.value} tier: register needs allocated slots, once each; bad: {bad or [b.slot for b in blocks]}"
                )
            earlier: set[int] = set()
            for b in blocks:
                if b.parent_hash is not None and b.parent_hash not in self._entries and b.parent_hash not in earlier:
                    raise UnknownBlockError(
                        f"{self.tier.value} tier: parent {b.parent_hash:#018x} of block {b.block_hash:#018x} "
                        "is not held (register a block after its parent)"
                    )
                earlier.add(b.block_hash)
            out: list[int] = []
            new: list[NewBlock] = []
            for b in blocks:
                self._allocated.discard(b.slot)
                existing = self._entries.get(b.block_hash)
                if existing is not None:
                    heapq.heappush(self._free, b.slot)
                    if pin:
                        self._pin(b.block_hash, existing)
                    out.append(existing.slot)
                    continue
                self._entries[b.block_hash] = _Entry(b.slot, b.parent_hash, b.tokens_hash, priority, 1 if pin else 0)
                if b.parent_hash is not None:
                    self._entries[b.parent_hash].children += 1
                new.append(b)
                out.append(b.slot)
            if not pin:
                # Children first in the LRU order, so that a chain is evicted from its tail.
                queue = self._lru.setdefault(priority, OrderedDict())
                for b in reversed(new):
                    queue[b.block_hash] = None
                self._evictable += len(new)
            if new:
                self._pool._registered(self.tier, new)
            return out

    def _pin(self, h: int, e: _Entry) -> None:
        if e.pins == 0:
            del self._lru[e.priority][h]
            self._evictable -= 1
        e.pins += 1

    def pin(self, block_hashes: Sequence[int], hit: bool = False) -> list[int]:
        """Pin held blocks (all or none) and return their slots. ``hit``: a request reuses
        them: their copies on every other tier become the most recently used there
        (recency is tier-wide), and listeners are told (the offload engine restores a
        missing G2 copy; its disk filter counts the use)."""
        with self._pool.locked():
            missing = [h for h in block_hashes if h not in self._entries]
            if missing:
                raise UnknownBlockError(f"{self.tier.value} tier holds no block {missing[0]:#018x}")
            slots = []
            for h in block_hashes:
                e = self._entries[h]
                self._pin(h, e)
                slots.append(e.slot)
            if hit and block_hashes:
                self._pool._hit(self.tier, tuple(block_hashes))
            return slots

    def unpin(self, block_hashes: Sequence[int]) -> None:
        """Release pins (all or none); a block whose last pin goes becomes the most
        recently used of its priority. List a chain parent first: its tail becomes the
        least recent of the chain, so it is evicted first and no child loses its parent."""
        with self._pool.locked():
            counts: dict[int, int] = {}
            for h in block_hashes:
                counts[h] = counts.get(h, 0) + 1
            for h, c in counts.items():
                e = self._entries.get(h)
                if e is None or e.pins < c:
                    raise UnknownBlockError(f"{self.tier.value} tier: block {h:#018x} is not pinned {c} time(s)")
            for h in reversed(block_hashes):
                e = self._entries[h]
                e.pins -= 1
                if e.pins == 0:
                    self._lru.setdefault(e.priority, OrderedDict())[h] = None
                    self._evictable += 1

    def remove(self, block_hashes: Sequence[int]) -> None:
        """Evict these unpinned blocks now (all or none)."""
        with self._pool.locked():
            for h in block_hashes:
                e = self._entries.get(h)
                if e is None:
                    raise UnknownBlockError(f"{self.tier.value} tier holds no block {h:#018x}")
                if e.pins:
                    raise BlockPinnedError(f"{self.tier.value} tier: block {h:#018x} is pinned")
            if len(set(block_hashes)) != len(block_hashes):
                raise UnknownBlockError(f"{self.tier.value} tier: remove lists a block twice")
            for h in block_hashes:
                e = self._entries.pop(h)
                self._orphan(e)
                queue = self._lru[e.priority]
                del queue[h]
                if not queue:
                    del self._lru[e.priority]
                self._evictable -= 1
                heapq.heappush(self._free, e.slot)
            if block_hashes:
                self._pool._emit(SourceRemoved(self.tier, self._pool.dp_rank, tuple(block_hashes)))

    def slot_of(self, block_hash: int) -> int:
        with self._pool.locked():
            e = self._entries.get(block_hash)
            if e is None:
                raise UnknownBlockError(f"{self.tier.value} tier holds no block {block_hash:#018x}")
            return e.slot


class _PoolLock:
    """The pool's re-entrant lock as a context manager (a class, not a generator: it is
    entered for every metadata query, so its cost shows in simulations)."""

    __slots__ = ("_pool",)

    def __init__(self, pool: TieredBlockPool) -> None:
        self._pool = pool

    def __enter__(self) -> None:
        pool = self._pool
        pool._lock.acquire()
        pool._depth += 1

    def __exit__(self, *exc: object) -> None:
        pool = self._pool
        pool._depth -= 1
        pending: list[Callable[[], None]] = []
        if pool._depth == 0:
            pending, pool._pending = pool._pending, []
        pool._lock.release()
        for call in pending:
            call()


class TieredBlockPool:
    """G1/G2/G3 block tiers of one worker (one dp rank), reporting to ``sink``.

    Build with ``create`` (the pool allocates G1) or ``adopt`` (an engine's per-layer KV
    tensors become G1).
    """

    def __init__(self, device_store: DeviceStorage, options: PoolOptions, sink: SourceEventSink) -> None:
        if options.dp_rank < 0:
            raise PoolConfigError(f"dp_rank must be >= 0, got {options.dp_rank}")
        self.layout: BlockLayout = device_store.layout
        self.sink = sink
        self.dp_rank = options.dp_rank
        self._lock = threading.RLock()
        self._depth = 0
        self._pending: list[Callable[[], None]] = []
        self._locked = _PoolLock(self)
        self._listeners: list[PoolListener] = []
        self.device_store = device_store
        self.device = BlockTier(self, Tier.DEVICE, device_store.capacity)
        pin = torch.cuda.is_available() if options.pin_host is None else options.pin_host
        host_blocks = capacity_blocks(options.host_capacity, self.layout, "host (G2)")
        self.host_store = TensorBlocks(self.layout, host_blocks, torch.device("cpu"), pin=pin)
        self.host = BlockTier(self, Tier.HOST_PINNED, host_blocks)
        self.disk_store: DiskBlocks | None = None
        self.disk: BlockTier | None = None
        if options.disk_capacity is not None:
            if options.disk_path is None:
                raise PoolConfigError("a disk (G3) capacity needs a disk_path for the block file")
            disk_blocks = capacity_blocks(options.disk_capacity, self.layout, "disk (G3)")
            self.disk_store = DiskBlocks(options.disk_path, disk_blocks, self.layout.block_bytes)
            self.disk = BlockTier(self, Tier.DISK, disk_blocks)
        elif options.disk_path is not None:
            raise PoolConfigError("disk_path is set but disk_capacity is not")

    @classmethod
    def create(
        cls,
        layout: BlockLayout,
        device_capacity: int | str,
        options: PoolOptions,
        sink: SourceEventSink,
        device: str | torch.device | None = None,
    ) -> TieredBlockPool:
        dev = torch.device(device) if device is not None else default_device()
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise PoolConfigError("device 'cuda' requested but CUDA is not available")
        blocks = capacity_blocks(device_capacity, layout, "device (G1)")
        return cls(TensorBlocks(layout, blocks, dev), options, sink)

    @classmethod
    def adopt(cls, kv_caches: Sequence[torch.Tensor], options: PoolOptions, sink: SourceEventSink) -> TieredBlockPool:
        return cls(LayerwiseBlocks(kv_caches), options, sink)

    @property
    def tiers(self) -> tuple[BlockTier, ...]:
        return (self.device, self.host) + ((self.disk,) if self.disk is not None else ())

    def tier(self, tier: Tier) -> BlockTier:
        for t in self.tiers:
            if t.tier == tier:
                return t
        raise PoolConfigError(f"this pool has no {tier.value} tier")

    # -- locking, events, listeners --------------------------------------------------------
    def locked(self) -> _PoolLock:
        """Hold the pool lock; listener calls queued meanwhile run after the outermost exit."""
        return self._locked

    def add_listener(self, listener: PoolListener) -> None:
        with self.locked():
            self._listeners.append(listener)

    def remove_listener(self, listener: PoolListener) -> None:
        with self.locked():
            self._listeners.remove(listener)

    def _emit(self, event: SourceStored | SourceRemoved) -> None:
        # Called under the lock: events leave in the order the tiers changed.
        self.sink.on_source_event(event)

    def _registered(self, tier: Tier, blocks: list[NewBlock]) -> None:
        # One SourceStored per chain of consecutive parent → child blocks.
        start = 0
        for i in range(1, len(blocks) + 1):
            if i == len(blocks) or blocks[i].parent_hash != blocks[i - 1].block_hash:
                chain = blocks[start:i]
                self._emit(
                    SourceStored(
                        tier,
                        self.dp_rank,
                        chain[0].parent_hash,
                        tuple(b.block_hash for b in chain),
                        tuple(b.tokens_hash for b in chain),
                    )
                )
                start = i
        if self._listeners:
            ready = None
            if tier is Tier.DEVICE and self.device_store.device.type == "cuda":
                ready = torch.cuda.current_stream(self.device_store.device).record_event()
            hashes = tuple(b.block_hash for b in blocks)
            for listener in list(self._listeners):
                self._pending.append(lambda listener=listener: listener.on_registered(tier, hashes, ready))

    def _hit(self, tier: Tier, hashes: tuple[int, ...]) -> None:
        for other in self.tiers:
            if other.tier is not tier:
                other.touch(hashes)
        for listener in list(self._listeners):
            self._pending.append(lambda listener=listener: listener.on_hit(tier, hashes))

    # -- block content ---------------------------------------------------------------------
    def write_block(self, slot: int, block: torch.Tensor) -> None:
        """Fill an allocated G1 slot (as an engine's forward pass would)."""
        self.layout.check_block(block)
        with self.locked():
            if slot not in self.device._allocated:
                raise UnknownBlockError(f"device slot {slot} is not allocated (registered blocks are immutable)")
        self.device_store.scatter([slot], block.unsqueeze(0))

    def read_block(self, tier: Tier, block_hash: int) -> bytes:
        """A copy of a block's bytes on ``tier`` (checks and tests)."""
        t = self.tier(tier)
        slot = t.pin([block_hash])[0]
        try:
            if tier is Tier.DEVICE:
                out = torch.empty((1, *self.layout.block_shape), dtype=self.layout.dtype, device=self.device_store.device)
                self.device_store.gather([slot], out)
                return out.cpu().view(torch.uint8).numpy().tobytes()
            if tier is Tier.HOST_PINNED:
                return self.host_store.byte_rows()[slot].numpy().tobytes()
            assert self.disk_store is not None
            buf = bytearray(self.layout.block_bytes)
            self.disk_store.read([slot], [memoryview(buf)])
            return bytes(buf)
        finally:
            t.unpin([block_hash])

    def close(self) -> None:
        """Release the G3 file (and remove it). Close the offload engine first."""
        with self.locked():
            if self._listeners:
                raise PoolConfigError("close the offload engine before its pool")
        if self.disk_store is not None:
            self.disk_store.close()
