"""The deterministic fold of ``kvstream.events`` records into a Router (DESIGN.md §7).

Everything a replica derives from the log happens here, with no Kafka and no wall
clock, so that two replicas (or a replay) that read the same records agree exactly:

- decode each record; undecodable ones are reported for the DLQ;
- per worker incarnation (epoch): a newer epoch wipes the old state, an older one is
  stale; per (worker, dp_rank): event ids at or below the last applied are duplicates,
  a jump past the next id is a gap (applied, counted, and the worker asked to resync);
- worker leases in *log time*: each partition's clock is the largest record timestamp
  read from it, and a worker silent on its partition for longer than its lease is
  removed. Workers and their records live on one partition (key = worker id), so all
  state is per partition, which is also what lets snapshots be taken a partition at a
  time (kvstream.replica.snapshot).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstream.events.errors import DecodeError
from kvstream.events.model import Cleared, EventBatch, Removed
from kvstream.router import Router

#: Header that marks a log-clock tick: a record with no events that only advances its
#: partition's log time (replicas publish them to idle partitions).
TICK_HEADER = "kvstream-tick"

# Counter reasons of the fold (the index adds its own: kvstream.router.index.REASONS).
DECODE_ERROR = "record_undecodable"
STALE_EPOCH = "batch_stale_epoch"
DUPLICATE = "event_duplicate"
GAP = "event_id_gap"
NO_CLEARED = "epoch_without_cleared"
EXPIRED = "worker_expired"


@dataclass(slots=True)
class WorkerLog:
    """What the fold knows of one worker incarnation."""

    partition: int
    epoch: int
    lease_ms: int
    last_seen_ms: int
    #: dp_rank → last applied event id in this epoch.
    last_ids: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the service must do about one record: copy it to the DLQ (with the reason),
    and/or ask workers to resync."""

    dlq_reason: str | None = None
    resync: tuple[int, ...] = ()
    applied_events: int = 0


@dataclass(slots=True)
class PartitionState:
    next_offset: int = 0
    #: The partition's log clock: the largest record timestamp read from it (ms).
    log_time_ms: int = 0


class LogFold:
    """Folds records of the events topic into ``router``. Single writer."""

    def __init__(self, router: Router, decode: Callable[[bytes], EventBatch]) -> None:
        self.router = router
        self._decode = decode
        self.partitions: dict[int, PartitionState] = {}
        self.workers: dict[int, WorkerLog] = {}
        self.counters: Counter[str] = Counter()
        #: Workers changed (or removed) since the snapshotter last took them.
        self.dirty: set[int] = set()
        # (deadline ms, worker id) per partition; stale entries are skipped lazily.
        self._deadlines: dict[int, list[tuple[int, int]]] = {}

    # -- records ---------------------------------------------------------------------

    def apply_record(
        self,
        partition: int,
        offset: int,
        timestamp_ms: int,
        value: bytes | None,
        is_tick: bool = False,
    ) -> Outcome:
        """Apply the record at ``offset`` of ``partition`` (records must come in offset
        order per partition)."""
        part = self.partitions.get(partition)
        if part is None:
            part = self.partitions[partition] = PartitionState()
        part.next_offset = offset + 1
        if timestamp_ms > part.log_time_ms:
            part.log_time_ms = timestamp_ms
        if is_tick:
            self._expire(partition, part.log_time_ms)
            return Outcome()
        try:
            if value is None:
                raise DecodeError("record has no value")
            batch = self._decode(value)
        except DecodeError as exc:
            self.counters[DECODE_ERROR] += 1
            return Outcome(dlq_reason=f"{DECODE_ERROR}: {exc}")
        outcome = self._apply_batch(partition, timestamp_ms, batch)
        self._expire(partition, part.log_time_ms)
        return outcome

    def _apply_batch(self, partition: int, ts: int, batch: EventBatch) -> Outcome:
        wid = batch.worker_id
        self.dirty.add(wid)
        log = self.workers.get(wid)
        resync: list[int] = []
        if log is not None and batch.epoch < log.epoch:
            self.counters[STALE_EPOCH] += 1
            return Outcome(dlq_reason=f"{STALE_EPOCH}: epoch {batch.epoch} < {log.epoch}")
        if log is None or batch.epoch > log.epoch:
            if log is not None:
                # A new incarnation replaces the old one even if its `cleared` was lost;
                # the old lease entry stays in the heap and serves the new incarnation.
                self.router.index.clear_worker(wid)
            else:
                heapq.heappush(self._deadlines.setdefault(partition, []), (ts + batch.lease_ms, wid))
            log = self.workers[wid] = WorkerLog(partition, batch.epoch, batch.lease_ms, ts)
            if batch.events and type(batch.events[0]) is not Cleared:
                self.counters[NO_CLEARED] += 1
                resync.append(wid)
        log.lease_ms = batch.lease_ms
        log.last_seen_ms = max(log.last_seen_ms, ts)
        rejected: list[str] = []
        applied = 0
        known = self.router.index.knows(wid)
        announced = False
        apply_event = self.router.apply_event
        last_ids = log.last_ids
        for i, ev in enumerate(batch.events):
            last = last_ids.get(ev.dp_rank)
            if last is not None:
                if ev.event_id <= last:
                    self.counters[DUPLICATE] += 1
                    continue
                if ev.event_id != last + 1:
                    self.counters[GAP] += 1
                    if wid not in resync:
                        resync.append(wid)
            last_ids[ev.dp_rank] = ev.event_id
            reason = apply_event(ev)
            if reason is None:
                applied += 1
                announced = announced or type(ev) is not Removed
            else:
                rejected.append(f"event {i} (id {ev.event_id}): {reason}")
        if not known and not announced and self.router.index.knows(wid):
            # A worker becomes a candidate by an accepted store or its `cleared` (an
            # empty cache is a real worker); rejected stores and removes of blocks it
            # never had must not make it one.
            self.router.index.remove_worker(wid)
        return Outcome(
            dlq_reason="; ".join(rejected) if rejected else None,
            resync=tuple(resync),
            applied_events=applied,
        )

    # -- leases ----------------------------------------------------------------------

    def _expire(self, partition: int, now_ms: int) -> None:
        heap = self._deadlines.get(partition)
        while heap and heap[0][0] < now_ms:
            _, wid = heapq.heappop(heap)
            log = self.workers.get(wid)
            if log is None:
                continue
            deadline = log.last_seen_ms + log.lease_ms
            if deadline >= now_ms:
                heapq.heappush(heap, (deadline, wid))  # renewed since it was pushed
                continue
            del self.workers[wid]
            self.dirty.add(wid)
            if self.router.index.knows(wid):
                self.router.remove_worker(wid)
            self.counters[EXPIRED] += 1

    # -- restore from a snapshot -------------------------------------------------------

    def restore_partition(self, partition: int, next_offset: int, log_time_ms: int) -> None:
        self.partitions[partition] = PartitionState(next_offset, log_time_ms)

    def restore_worker(self, worker_id: int, log: WorkerLog) -> None:
        self.workers[worker_id] = log
        heapq.heappush(
            self._deadlines.setdefault(log.partition, []), (log.last_seen_ms + log.lease_ms, worker_id)
        )

    # -- views -----------------------------------------------------------------------

    def next_offsets(self) -> dict[int, int]:
        return {p: s.next_offset for p, s in sorted(self.partitions.items())}
