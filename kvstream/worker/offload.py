"""The asynchronous offload engine (DESIGN.md §8): write-through G1 → G2 → G3.

- Every block registered on G1 is pinned there and queued (priority, then arrival) for
  G2. One worker takes batches off the queue, allocates G2 slots (evicting), copies the
  batch (on a GPU: gathered on the device into a staging buffer, then one copy per run of
  consecutive G2 slots, on the engine's own CUDA stream, completion by event; on a CPU:
  directly, in the worker thread) and registers the blocks on G2.
- A block on G2 goes on to G3 once the disk filter has seen it ``disk_min_seen`` times
  (each G1 registration or reuse is one sighting; counts halve every ``filter_decay``
  sightings). The default is one sighting, not DESIGN §8's "seen twice": in multi-turn
  traffic a turn's new blocks are reused by the next turn, so a block seen once already
  predicts reuse, and a second sighting usually comes from G1 or G2, too late for G3 to
  matter (docs/RESULTS.md: on the Mooncake conversation trace G3 served 3.5 % of prompt
  blocks with two sightings, 9.6 % with one). A pool of disk threads writes batches with
  one gathered write per run of consecutive G3 slots.
- A target tier that already holds a block is skipped. A block whose parent the target
  lacks brings its ancestors along (from the source tier), so chains on G2 and G3 stay
  prefix-closed. A G1 hit restores a missing G2 copy (the pool refreshes present ones on
  every tier), so a prefix stays on G2 for as long as requests use it. Queues are bounded: a producer
  waits while its queue is full (back-pressure), and pinned blocks never exceed queue
  size plus in-flight batches.
- ``close`` drains the queues, or cancels what is still queued (unpinning it); copies
  already in flight always complete and are registered, then every thread is joined.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Generic, TypeVar

import torch

from kvstream.events.model import Tier
from kvstream.logs import get_logger
from kvstream.worker.errors import OffloadClosedError, PoolConfigError
from kvstream.worker.layout import copy_down
from kvstream.worker.pool import BlockInfo, BlockTier, NewBlock, TieredBlockPool

log = get_logger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class OffloadOptions:
    #: Blocks per copy (one staging buffer of this many blocks on a GPU).
    batch_blocks: int = 16
    #: Bound of each queue, in blocks.
    queue_blocks: int = 256
    #: Threads writing G2 → G3.
    disk_threads: int = 2
    #: Sightings before a block is written to disk (1: every block that reaches G2; 2
    #: is DESIGN §8's "seen twice", for workloads where most blocks are never reused).
    disk_min_seen: int = 1
    #: Every count of the disk filter halves after this many sightings (bounds its memory too).
    filter_decay: int = 65536
    #: G1 → G2 batches issued ahead of their completion on a GPU.
    inflight_batches: int = 4
    #: Copy on the calling thread, within the pool's listener call, instead of in the
    #: engine's threads: the same decisions in one deterministic order, so that a
    #: simulation replays identically (kvstream simulate).
    inline: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "inline":
                continue
            value = getattr(self, f.name)
            if not isinstance(value, int) or value <= 0:
                raise PoolConfigError(f"offload option {f.name} must be a positive integer, got {value!r}")


class DiskFilter:
    """Counts sightings of each block; all counts halve every ``decay`` sightings, so
    old popularity fades and at most ``decay`` blocks are tracked."""

    def __init__(self, min_seen: int, decay: int) -> None:
        self.min_seen = min_seen
        self.decay = decay
        self._counts: dict[int, int] = {}
        self._since_decay = 0
        self._lock = threading.Lock()

    def observe(self, block_hash: int) -> int:
        with self._lock:
            count = self._counts.get(block_hash, 0) + 1
            self._counts[block_hash] = count
            self._since_decay += 1
            if self._since_decay >= self.decay:
                self._since_decay = 0
                self._counts = {h: c // 2 for h, c in self._counts.items() if c > 1}
            return count

    def count(self, block_hash: int) -> int:
        with self._lock:
            return self._counts.get(block_hash, 0)

    def passes(self, block_hash: int) -> bool:
        return self.count(block_hash) >= self.min_seen


class BoundedQueue(Generic[T]):
    """Highest priority first, then arrival order; ``put`` waits while full."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._heap: list[tuple[int, int, T]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        with self._cv:
            return len(self._heap)

    def put(self, priority: int, item: T) -> bool:
        """Queue ``item``, waiting for room; False (item not queued) once closed."""
        with self._cv:
            self._cv.wait_for(lambda: self._closed or len(self._heap) < self.maxsize)
            if self._closed:
                return False
            heapq.heappush(self._heap, (-priority, next(self._seq), item))
            self._cv.notify_all()
            return True

    def get_batch(self, n: int, timeout: float | None = None) -> list[T]:
        """Up to ``n`` items, waiting up to ``timeout`` for the first; [] when closed and empty."""
        with self._cv:
            self._cv.wait_for(lambda: self._closed or self._heap, timeout)
            out = [heapq.heappop(self._heap)[2] for _ in range(min(n, len(self._heap)))]
            if out:
                self._cv.notify_all()
            return out

    @property
    def finished(self) -> bool:
        with self._cv:
            return self._closed and not self._heap

    def close(self) -> list[T]:
        """Refuse new items, wake every waiter, and hand back what was still queued."""
        with self._cv:
            self._closed = True
            left = [entry[2] for entry in sorted(self._heap)]
            self._heap.clear()
            self._cv.notify_all()
            return left


@dataclass(frozen=True, slots=True)
class _Job:
    block_hash: int
    ready: torch.cuda.Event | None = None


@dataclass(slots=True)
class _Batch:
    infos: list[BlockInfo]
    dst_slots: list[int]
    done: torch.cuda.Event | None


@dataclass(slots=True)
class OffloadStats:
    """Block counts since the engine started."""

    queued_host: int = 0
    written_host: int = 0
    queued_disk: int = 0
    written_disk: int = 0
    #: The target tier already held the block (or it was already queued for it).
    skipped_present: int = 0
    #: The target tier had no free or evictable slot left.
    skipped_no_space: int = 0
    #: The block's parent was not on the target tier (a store there could not be reported).
    skipped_orphan: int = 0
    #: Evicted from G1 before the engine could pin it.
    source_gone: int = 0
    failed: int = 0
    cancelled: int = 0
    bytes_host: int = 0
    bytes_disk: int = 0


@dataclass(frozen=True, slots=True)
class ShutdownReport:
    #: Everything queued was written before the queues closed.
    drained: bool
    stats: OffloadStats


@dataclass(slots=True)
class _Stage:
    """One hop down the tiers: its queue and the hashes queued or in flight on it."""

    name: str
    source: BlockTier
    target: BlockTier
    queue: BoundedQueue[_Job]
    pending: set[int] = field(default_factory=set)


class OffloadEngine:
    """Write-through offload of a pool's G1 blocks to G2, and of popular ones to G3."""

    def __init__(self, pool: TieredBlockPool, options: OffloadOptions | None = None) -> None:
        self.pool = pool
        self.options = options or OffloadOptions()
        self.filter = DiskFilter(self.options.disk_min_seen, self.options.filter_decay)
        self._stats = OffloadStats()
        self._stats_lock = threading.Lock()
        self._idle = threading.Condition()
        self._outstanding = 0
        self._closed = False
        size = self.options.queue_blocks
        self._host = _Stage("g2", pool.device, pool.host, BoundedQueue(size))
        self._disk = _Stage("g3", pool.host, pool.disk, BoundedQueue(size)) if pool.disk is not None else None
        # Disk batches are written in parallel but registered in the order they were
        # taken, so that a parent is registered before its children.
        self._disk_take = threading.Lock()
        self._disk_tickets = itertools.count()
        self._disk_turn = threading.Condition()
        self._disk_next = 0
        self._host_rows = pool.host_store.byte_rows().numpy()
        dev = pool.device_store.device
        self._stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        self._staging = (
            torch.empty((self.options.batch_blocks, *pool.layout.block_shape), dtype=pool.layout.dtype, device=dev)
            if self._stream is not None
            else None
        )
        self._threads: list[threading.Thread] = []
        if not self.options.inline:
            self._threads.append(threading.Thread(target=self._host_loop, name="kvstream-offload-g2", daemon=True))
        if self._disk is not None and not self.options.inline:
            self._threads += [
                threading.Thread(target=self._disk_loop, name=f"kvstream-offload-g3-{i}", daemon=True)
                for i in range(self.options.disk_threads)
            ]
        for t in self._threads:
            t.start()
        pool.add_listener(self)

    # -- accounting -----------------------------------------------------------------------
    def stats(self) -> OffloadStats:
        with self._stats_lock:
            return OffloadStats(**{f.name: getattr(self._stats, f.name) for f in fields(OffloadStats)})

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _begin(self, n: int) -> None:
        with self._idle:
            self._outstanding += n

    def _end(self, n: int) -> None:
        with self._idle:
            self._outstanding -= n
            if self._outstanding == 0:
                self._idle.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or in flight; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)

    # -- pool listener ----------------------------------------------------------------------
    def on_registered(self, tier: Tier, blocks: tuple[int, ...], ready: torch.cuda.Event | None) -> None:
        if tier is not Tier.DEVICE:
            return
        for h in blocks:
            self.filter.observe(h)
        present = self._enqueue(self._host, blocks, ready)
        self._maybe_to_disk(present)

    def on_hit(self, tier: Tier, blocks: tuple[int, ...]) -> None:
        if tier is not Tier.DEVICE:
            return
        for h in blocks:
            self.filter.observe(h)
        # A G1 hit restores a G2 copy that was evicted meanwhile (the pool already made
        # the held ones recent): a hot prefix stays on G2 for as long as it is used. Its
        # content is complete: it was registered before this request could hit it.
        present = self._enqueue(self._host, blocks, None)
        self._maybe_to_disk(present)

    def _maybe_to_disk(self, blocks: Sequence[int]) -> None:
        if self._disk is not None:
            self._enqueue(self._disk, [h for h in blocks if self.filter.passes(h)], None)

    def _enqueue(self, stage: _Stage, blocks: Sequence[int], ready: torch.cuda.Event | None) -> list[int]:
        """Pin and queue the blocks that the stage's source holds and its target lacks,
        each after the ancestors it needs on the target (taken from the source, at the
        child's priority if higher), so that no copy arrives without its parent; returns
        those the target already holds (or that are on their way there)."""
        jobs: list[tuple[int, _Job]] = []
        present: list[int] = []
        gone = orphans = 0
        with self.pool.locked():
            for h in blocks:
                info = stage.source.info(h)
                if stage.target.holds(h) or h in stage.pending:
                    present.append(h)
                    continue
                if info is None:
                    gone += 1
                    continue
                chain = self._missing_ancestors(stage, info)
                if chain is None:
                    orphans += 1
                    continue
                for a in chain + [info]:
                    stage.source.pin([a.block_hash])
                    stage.pending.add(a.block_hash)
                    jobs.append((max(a.priority, info.priority), _Job(a.block_hash, ready)))
            self._begin(len(jobs))  # under the lock: wait_idle never misses a pinned block
        # On G1 a just-registered block can only be missing if it was evicted meanwhile;
        # on G2 a block seen on G1 may simply never have been offloaded.
        self._count(skipped_present=len(present), skipped_orphan=orphans,
                    source_gone=gone if stage is self._host else 0)
        if self.options.inline:
            self._count(**{f"queued_{'host' if stage is self._host else 'disk'}": len(jobs)})
            self._run_inline(stage, jobs)
            return present
        for k, (priority, job) in enumerate(jobs):
            if not stage.queue.put(priority, job):
                self._cancel(stage, [j for _, j in jobs[k:]])
                break
        self._count(**{f"queued_{'host' if stage is self._host else 'disk'}": len(jobs)})
        return present

    @staticmethod
    def _missing_ancestors(stage: _Stage, info: BlockInfo) -> list[BlockInfo] | None:
        """The ancestors of ``info``'s block that the stage's target neither holds nor
        awaits, root first; None when one of them is not on the source either (the
        block could not be reported on the target). Called under the pool lock."""
        out: list[BlockInfo] = []
        parent = info.parent_hash
        while parent is not None and not stage.target.holds(parent) and parent not in stage.pending:
            up = stage.source.info(parent)
            if up is None:
                return None
            out.append(up)
            parent = up.parent_hash
        out.reverse()
        return out

    def _run_inline(self, stage: _Stage, jobs: list[tuple[int, _Job]]) -> None:
        """Copy ``jobs`` now, in queue order (priority, then arrival: the sort is stable)
        and in batches, as the threads would have."""
        ordered = [job for _, job in sorted(jobs, key=lambda pj: -pj[0])]
        n = self.options.batch_blocks
        for k in range(0, len(ordered), n):
            batch = ordered[k : k + n]
            if stage is self._host:
                issued = self._issue_host(batch)
                if issued is not None:
                    self._finish_host(issued)
            else:
                written = self._write_disk(stage, batch)
                if written is not None:
                    self._complete(stage, *written)

    # -- both stages -------------------------------------------------------------------------
    def _select(self, stage: _Stage, jobs: list[_Job]) -> tuple[list[BlockInfo], list[int]]:
        """The blocks of a batch worth copying, and target slots for them; the rest are
        released: already on the target, orphans (their parent neither on the target nor
        on its way there), or beyond the target's room."""
        infos: list[BlockInfo] = []
        present: list[int] = []
        orphans: list[int] = []
        with self.pool.locked():
            for job in jobs:
                info = stage.source.info(job.block_hash)
                assert info is not None and info.pins > 0  # pinned when queued
                parent = info.parent_hash
                if stage.target.holds(job.block_hash):
                    present.append(job.block_hash)
                elif parent is not None and not stage.target.holds(parent) and parent not in stage.pending:
                    orphans.append(job.block_hash)
                else:
                    infos.append(info)
            dst = stage.target.allocate(len(infos), partial=True)
            short = [i.block_hash for i in infos[len(dst) :]]
            infos = infos[: len(dst)]
            self._release(stage, present + orphans + short)
        if short:
            log.warning("offload_target_full", stage=stage.name, blocks=len(short), capacity=stage.target.capacity)
        self._count(skipped_present=len(present), skipped_orphan=len(orphans), skipped_no_space=len(short))
        if stage is self._host:
            self._maybe_to_disk(present)
        self._end(len(present) + len(orphans) + len(short))
        return infos, dst

    def _complete(self, stage: _Stage, infos: list[BlockInfo], dst: list[int]) -> None:
        """Register copied blocks on the target, unpinned, parents first; a block whose
        parent did not make it (evicted, skipped) is dropped, since the target could not
        report it."""
        registered: list[int] = []
        held: set[int] = set()
        with self.pool.locked():
            target = stage.target
            keep: list[tuple[BlockInfo, int]] = []
            orphans: list[int] = []
            for info, slot in zip(infos, dst):
                parent = info.parent_hash
                if parent is None or target.holds(parent) or parent in held:
                    keep.append((info, slot))
                    registered.append(info.block_hash)
                    held.add(info.block_hash)
                else:
                    orphans.append(slot)
            if orphans:
                target.free(orphans)
            # one register call per run of equal priority: a chain is reported as one store
            start = 0
            for i in range(1, len(keep) + 1):
                if i == len(keep) or keep[i][0].priority != keep[start][0].priority:
                    target.register(
                        [NewBlock(slot, b.block_hash, b.parent_hash, b.tokens_hash) for b, slot in keep[start:i]],
                        priority=keep[start][0].priority,
                        pin=False,
                    )
                    start = i
            self._release(stage, [i.block_hash for i in infos])
        n = len(registered)
        if stage is self._host:
            self._count(written_host=n, bytes_host=n * self.pool.layout.block_bytes, skipped_orphan=len(orphans))
            self._maybe_to_disk(registered)
        else:
            self._count(written_disk=n, bytes_disk=n * self.pool.layout.block_bytes, skipped_orphan=len(orphans))
        self._end(len(infos))

    def _fail(self, stage: _Stage, infos: list[BlockInfo], dst: list[int]) -> None:
        log.exception("offload_copy_failed", stage=stage.name, blocks=len(infos))
        stage.target.free(dst)
        self._release(stage, [i.block_hash for i in infos])
        self._count(failed=len(infos))
        self._end(len(infos))

    def _release(self, stage: _Stage, hashes: Sequence[int]) -> None:
        with self.pool.locked():
            stage.source.unpin(hashes)
            stage.pending.difference_update(hashes)

    def _cancel(self, stage: _Stage, jobs: Sequence[_Job]) -> None:
        self._release(stage, [j.block_hash for j in jobs])
        self._count(cancelled=len(jobs))
        self._end(len(jobs))

    # -- G1 → G2 ------------------------------------------------------------------------------
    def _host_loop(self) -> None:
        inflight: deque[_Batch] = deque()
        n = self.options.batch_blocks
        while True:
            # With batches in flight, only poll, so that finished ones are registered promptly.
            jobs = self._host.queue.get_batch(n, timeout=0 if inflight else None)
            if jobs:
                if len(inflight) >= self.options.inflight_batches:
                    self._finish_host(inflight.popleft())
                batch = self._issue_host(jobs)
                if batch is not None:
                    inflight.append(batch)
            elif inflight:
                self._finish_host(inflight.popleft())
            elif self._host.queue.finished:
                return

    def _issue_host(self, jobs: list[_Job]) -> _Batch | None:
        pool = self.pool
        infos, dst = self._select(self._host, jobs)
        if not infos:
            return None
        src = [i.slot for i in infos]
        try:
            if self._stream is None:
                copy_down(pool.device_store, src, pool.host_store, dst, None)
                return _Batch(infos, dst, None)
            with torch.cuda.stream(self._stream):
                # the blocks' content was written on the registering thread's stream
                for ready in {id(j.ready): j.ready for j in jobs if j.ready is not None}.values():
                    self._stream.wait_event(ready)
                copy_down(pool.device_store, src, pool.host_store, dst, self._staging)
                return _Batch(infos, dst, self._stream.record_event())
        except Exception:
            self._fail(self._host, infos, dst)
            return None

    def _finish_host(self, batch: _Batch) -> None:
        if batch.done is not None:
            try:
                batch.done.synchronize()
            except Exception:
                self._fail(self._host, batch.infos, batch.dst_slots)
                return
        self._complete(self._host, batch.infos, batch.dst_slots)

    # -- G2 → G3 ------------------------------------------------------------------------------
    def _disk_loop(self) -> None:
        stage = self._disk
        assert stage is not None
        while True:
            with self._disk_take:
                jobs = stage.queue.get_batch(self.options.batch_blocks)
                if not jobs:
                    return
                ticket = next(self._disk_tickets)
            written: tuple[list[BlockInfo], list[int]] | None = None
            try:
                written = self._write_disk(stage, jobs)
            finally:
                with self._disk_turn:
                    self._disk_turn.wait_for(lambda: self._disk_next == ticket)
                    try:
                        if written is not None:
                            self._complete(stage, *written)
                    finally:
                        self._disk_next += 1
                        self._disk_turn.notify_all()

    def _write_disk(self, stage: _Stage, jobs: list[_Job]) -> tuple[list[BlockInfo], list[int]] | None:
        disk_store = self.pool.disk_store
        assert disk_store is not None
        infos, dst = self._select(stage, jobs)
        if not infos:
            return None
        try:
            disk_store.write(dst, [self._host_rows[i.slot] for i in infos])
        except Exception:
            self._fail(stage, infos, dst)
            return None
        return infos, dst

    # -- shutdown ------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, drain: bool = True, timeout: float | None = None) -> ShutdownReport:
        """Stop taking work. ``drain``: first finish everything queued (up to ``timeout``);
        whatever is still queued then is cancelled and its pins released. Copies in flight
        complete and are registered before this returns."""
        if self._closed:
            raise OffloadClosedError("the offload engine is already closed")
        self._closed = True
        self.pool.remove_listener(self)
        drained = self.wait_idle(timeout) if drain else False
        # G1 → G2 first: its in-flight batches may still queue blocks for G3.
        self._cancel(self._host, self._host.queue.close())
        for t in self._threads[:1]:
            t.join()
        if self._disk is not None:
            self._cancel(self._disk, self._disk.queue.close())
        for t in self._threads[1:]:
            t.join()
        if self._stream is not None:
            self._stream.synchronize()
        report = ShutdownReport(drained=drained, stats=self.stats())
        log.info("offload_closed", drained=drained, cancelled=report.stats.cancelled)
        return report
