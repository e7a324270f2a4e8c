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
  time (kvstream.replica.snapshot);
- the log's authority (kvstream.replica.authority): key, allow-list, plausible epochs
  and leases, block limits per event and per worker, workers per partition;
- a worker incarnation is bound to a partition. Incarnations are ordered by epoch, then
  by partition, lower first: a batch of a greater incarnation replaces the worker's
  state (wherever it is), a batch of a lesser one is rejected (``batch_stale_epoch``,
  or ``batch_wrong_partition`` for the same epoch on a higher partition, which also asks
  the worker to resync). The winner is the greatest incarnation whatever order the
  partitions are read in, so live replicas, fresh ones and replay agree after
  partitions are added (docs/RELIABILITY.md, "Topology changes").

Every record that decodes comes to the fold in one form, whatever schema version wrote
it (:class:`PackedReader`; :meth:`~kvstream.events.codec.EventCodec.read_packed`): its
hashes packed in v1 bytes, which the index applies from directly, and each event's
digest. One path decides over that form and applies it (kvstream bench ingest;
tests/replica/test_fold_paths.py checks it against the model objects' decoding).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvstream.events.codec import PACKED_KINDS, PACKED_TIERS, PackedEvent, PackedRecord
from kvstream.events.errors import DecodeError
from kvstream.events.model import Cleared, Removed, Stored
from kvstream.logs import get_logger
from kvstream.replica.authority import TRUSTING, WORKER_FULL, LogAuthority
from kvstream.router import Router

if TYPE_CHECKING:
    from kvstream.replica.record import Record

_log = get_logger(__name__)

# Counter reasons of the fold (the index adds its own: kvstream.router.index.REASONS).
DECODE_ERROR = "record_undecodable"
STALE_EPOCH = "batch_stale_epoch"
DUPLICATE = "event_duplicate"
GAP = "event_id_gap"
NO_CLEARED = "epoch_without_cleared"
EXPIRED = "worker_expired"
WRONG_PARTITION = "batch_wrong_partition"
#: An event id that the worker already used, with other content: another producer took
#: the id (or the worker restarted without a new epoch); the worker is asked to resync.
ID_CONFLICT = "event_id_conflict"
#: A stale batch stamped after the incarnation that replaced it began: two processes
#: publish as one worker id (a worker started twice), not a late batch of a dead one.
WORKER_CLASH = "worker_id_clash"
#: Log time without a clash after which the next one is a new episode (logged again).
CLASH_QUIET_MS = 60_000
#: A worker that had stored no block, removed to make room on a full partition.
DISPLACED = "worker_displaced"
#: The fold itself failed on a record (a bug). Deterministic like the rest, so every
#: replica fails the same way on it: the record is dead-lettered, ingest goes on.
FOLD_ERROR = "record_fold_error"
#: A header kvstream reads (kvstream.replica.record) is malformed: counted and the record
#: dead-lettered by reference; its events still apply (headers are advisory).
BAD_HEADER = "record_bad_header"


#: Records folded between two looks at the clock while the ingest thread holds the
#: router lock.
FOLD_SLICE = 16
#: How long the ingest thread holds the router lock at most before routes get their
#: turn: a catch-up consume (2,000 records) folded in one hold would stall every route
#: for as long as it takes. ~1 ms is what a slice of 16 records at ~70 µs took before
#: the fold read records packed; giving the GIL up after every 16 records at ~5 µs each
#: would cost more than the records (time.sleep(0) measured ~85 µs here).
FOLD_HOLD_S = 0.001

_T = TypeVar("_T")
# Kind codes of the codec's packed events.
_STORED, _REMOVED, _CLEARED = (PACKED_KINDS.index(k) for k in (Stored, Removed, Cleared))


def log_time(ms: int) -> str:
    """A log timestamp (ms) as ISO 8601 UTC, for messages."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def fold_in_slices(
    lock: AbstractContextManager[Any],
    records: Sequence[_T],
    apply: Callable[[Sequence[_T]], None],
    size: int = FOLD_SLICE,
    hold_s: float = FOLD_HOLD_S,
) -> None:
    """``apply`` consecutive slices of ``records`` of at most ``size``, under holds of
    ``lock`` of at most about ``hold_s`` (and one slice) each. The GIL is given up
    between holds, so that a route thread woken by the release takes the lock before
    this thread takes it again; not after the last one (a thread that folds a few
    records per wake-up would otherwise queue behind every route for a GIL switch
    interval, and fall behind a busy router)."""
    step = max(1, size)
    clock = time.perf_counter
    i, n = 0, len(records)
    while i < n:
        if i:
            time.sleep(0)
        with lock:
            until = clock() + hold_s
            while True:
                apply(records[i : i + step])
                i += step
                if i >= n or clock() >= until:
                    break


#: Event ids per (worker, rank) whose digests the fold keeps (kvstream.replica.fold.WorkerLog).
RECENT_IDS = 32


@dataclass(slots=True)
class WorkerLog:
    """What the fold knows of one worker incarnation."""

    partition: int
    epoch: int
    lease_ms: int
    last_seen_ms: int
    #: dp_rank → last applied event id in this epoch.
    last_ids: dict[int, int] = field(default_factory=dict)
    #: dp_rank → {event id: digest} of the last RECENT_IDS events whose id was taken (in
    #: snapshots too): it tells a redelivered event from another one that reuses its id,
    #: also when another producer took several ids ahead of the worker.
    recent: dict[int, dict[int, int]] = field(default_factory=dict)
    #: Whether a store of this epoch was accepted: a worker counts against its
    #: partition's worker limit only then (kvstream.replica.fold.LogFold._displace_blockless).
    stored: bool = False

    def conflicts(self, rank: int, event_id: int, digest: int) -> bool:
        """Whether an event of ``digest`` reuses an id of the recent window with other
        content (an older id, outside the window, is taken for a redelivery)."""
        seen = self.recent.get(rank)
        known = seen.get(event_id) if seen else None
        return known is not None and known != digest

    def remember(self, rank: int, event_id: int, digest: int) -> None:
        seen = self.recent.get(rank)
        if seen is None:
            seen = self.recent[rank] = {}
        seen[event_id] = digest
        if len(seen) > RECENT_IDS:
            del seen[next(iter(seen))]  # ids only grow: the first is the oldest

    def outranks(self, epoch: int, partition: int) -> bool:
        """Whether this incarnation is greater than (epoch, partition): a higher epoch,
        or the same epoch on a lower partition."""
        return (self.epoch, -self.partition) > (epoch, -partition)


@dataclass(slots=True)
class Clash:
    """Two live incarnations of one worker id, as the log shows them (not in snapshots:
    a report, not state)."""

    #: The incarnation the log holds, and the older one still publishing beside it.
    held_epoch: int
    stale_epoch: int
    #: Log time (ms) of the last stale batch, and how many came after the held one began.
    last_ms: int
    batches: int = 1

    def view(self) -> dict[str, Any]:
        return {
            "held_epoch": self.held_epoch, "stale_epoch": self.stale_epoch, "last_at": log_time(self.last_ms),
            "batches": self.batches,
        }


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the service must do about one record: copy it to the DLQ (with the reason),
    and/or ask workers to resync."""

    dlq_reason: str | None = None
    resync: tuple[int, ...] = ()
    applied_events: int = 0


#: Outcomes of records applied whole (shared: an Outcome is immutable).
_APPLIED = tuple(Outcome(applied_events=n) for n in range(64))


@dataclass(slots=True)
class PartitionState:
    next_offset: int = 0
    #: The partition's log clock: the largest record timestamp read from it (ms).
    log_time_ms: int = 0


class PackedReader(Protocol):
    """Reads a record's value into the fold's form (kvstream.events.codec.EventCodec)."""

    def read_packed(self, data: bytes) -> PackedRecord:
        """The record's events with their hashes packed and their digests, or
        DecodeError saying why it cannot be applied."""
        ...


class LogFold:
    """Folds records of the events topic into ``router``. Single writer."""

    def __init__(
        self,
        router: Router,
        reader: PackedReader,
        authority: LogAuthority = TRUSTING,
    ) -> None:
        self.router = router
        self._read = reader.read_packed
        self.authority = authority
        self.partitions: dict[int, PartitionState] = {}
        self.workers: dict[int, WorkerLog] = {}
        self.counters: Counter[str] = Counter()
        #: Workers changed (or removed) since the snapshotter last took them.
        self.dirty: set[int] = set()
        # (deadline ms, worker id) per partition; stale entries are skipped lazily.
        self._deadlines: dict[int, list[tuple[int, int]]] = {}
        #: Workers bound to each partition (for the per-partition limit).
        self._bound: Counter[int] = Counter()
        #: (last seen ms, worker id) per partition of incarnations that had stored
        #: nothing when pushed: who makes room for a newcomer; stale entries are skipped
        #: lazily, as for the deadlines.
        self._blockless: dict[int, list[tuple[int, int]]] = {}
        #: Per partition, an upper bound of the blocks its workers hold (stores added,
        #: nothing taken off): counted exactly only when the budget would reject a store.
        self._partition_held: dict[int, int] = {}
        #: Log time (ms) at which each worker's current incarnation began (unknown for
        #: one restored from a snapshot until it changes), and the clashes seen.
        self._began: dict[int, int] = {}
        self.clashes: dict[int, Clash] = {}

    # -- records ---------------------------------------------------------------------

    def apply(self, record: Record) -> Outcome:
        """Apply a record read by kvstream.replica.record.read_record."""
        return self.apply_record(
            record.partition, record.offset, record.timestamp_ms, record.value, record.is_tick, record.key,
            record.problem,
        )

    def apply_record(
        self,
        partition: int,
        offset: int,
        timestamp_ms: int,
        value: bytes | None,
        is_tick: bool = False,
        key: bytes | None = None,
        problem: str | None = None,
    ) -> Outcome:
        """Apply the record at ``offset`` of ``partition`` (records must come in offset
        order per partition); ``key`` is the record's key, ``problem`` what was wrong
        with its headers (kvstream.replica.record)."""
        outcome = self._apply_record(partition, offset, timestamp_ms, value, is_tick, key)
        if problem is None:
            return outcome
        self.counters[BAD_HEADER] += 1
        note = f"{BAD_HEADER}: {problem}"
        return Outcome(
            note if outcome.dlq_reason is None else f"{note}; {outcome.dlq_reason}",
            outcome.resync, outcome.applied_events,
        )

    def _apply_record(
        self, partition: int, offset: int, timestamp_ms: int, value: bytes | None, is_tick: bool, key: bytes | None
    ) -> Outcome:
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
            data, (wid, epoch, lease_ms, events) = self._read(value)
            rejected = self.authority.check_head(key, timestamp_ms, wid, epoch, lease_ms)
            if rejected is not None:
                self.counters[rejected.reason] += 1
                outcome = Outcome(dlq_reason=str(rejected))
            else:
                outcome = self._apply_batch(partition, timestamp_ms, data, wid, epoch, lease_ms, events)
        except DecodeError as exc:  # only the read raises it
            self.counters[DECODE_ERROR] += 1
            return Outcome(dlq_reason=f"{DECODE_ERROR}: {exc}")
        except MemoryError:
            raise  # not a property of the record: the replica cannot go on
        except Exception as exc:
            outcome = self._fold_error(partition, offset, exc)
        self._expire(partition, part.log_time_ms)
        return outcome

    def _fold_error(self, partition: int, offset: int, exc: Exception) -> Outcome:
        _log.exception("fold failed on a record", partition=partition, offset=offset)
        self.counters[FOLD_ERROR] += 1
        return Outcome(dlq_reason=f"{FOLD_ERROR}: {type(exc).__name__}: {exc}")

    def _apply_batch(
        self, partition: int, ts: int, data: bytes, wid: int, epoch: int, lease_ms: int,
        events: tuple[PackedEvent, ...],
    ) -> Outcome:
        """Apply a batch of ``wid``'s incarnation ``epoch``, its events' hashes packed in
        ``data``."""
        log = self.workers.get(wid)
        resync: list[int] = []
        if log is None or log.epoch != epoch or log.partition != partition:
            if log is not None and log.outranks(epoch, partition):
                if epoch < log.epoch:
                    return self._stale(wid, epoch, log.epoch, ts)
                self.counters[WRONG_PARTITION] += 1
                return Outcome(
                    dlq_reason=f"{WRONG_PARTITION}: worker {wid} epoch {epoch} is bound to partition "
                    f"{log.partition}, not {partition} (a worker starts a new epoch after partitions are added)",
                    resync=(wid,),
                )
            if log is None or log.partition != partition:
                full = self.authority.partition_full(self._bound[partition])
                if full is not None and not self._displace_blockless(partition):
                    self.counters[full.reason] += 1
                    return Outcome(dlq_reason=str(full))
                heapq.heappush(self._deadlines.setdefault(partition, []), (ts + lease_ms, wid))
                self._bound[partition] += 1
            if log is not None:
                # A new incarnation replaces the old one even if its `cleared` was lost;
                # on the same partition the old lease entry serves the new incarnation.
                self.router.clear_worker(wid)
                if log.partition != partition:
                    self._bound[log.partition] -= 1
            log = self.workers[wid] = WorkerLog(partition, epoch, lease_ms, ts)
            self._began[wid] = ts
            heapq.heappush(self._blockless.setdefault(partition, []), (ts, wid))
            if events and events[0][0] != _CLEARED:
                self.counters[NO_CLEARED] += 1
                resync.append(wid)
        self.dirty.add(wid)
        log.lease_ms = lease_ms
        if ts > log.last_seen_ms:
            log.last_seen_ms = ts
        rejected: list[str] = []
        applied = 0
        router = self.router
        known = router.knows(wid)
        announced = False
        apply = router.apply_packed
        authority = self.authority
        check_blocks = authority.check_blocks
        # The partition's block budget by an upper bound of what its workers hold (stores
        # added, nothing taken off): counted exactly only where it is unknown or would refuse.
        budgeted = authority.max_blocks_per_partition is not None
        partition_full = authority.partition_blocks_full
        bounds = self._partition_held
        last_ids = log.last_ids
        # Blocks the worker holds, an upper bound (stores added, removes not taken off),
        # counted at its first store: counted exactly only when the bound would reject one.
        held = -1
        for i, (kind, rank, tier, eid, parent, blocks_at, tokens_at, n, digest) in enumerate(events):
            last = last_ids.get(rank)
            if last is not None:
                if eid <= last:
                    if log.conflicts(rank, eid, digest):
                        self.counters[ID_CONFLICT] += 1
                        rejected.append(f"event {i} (id {eid}): {ID_CONFLICT}")
                        if wid not in resync:
                            resync.append(wid)
                    else:
                        self.counters[DUPLICATE] += 1
                    continue
                if eid != last + 1:
                    self.counters[GAP] += 1
                    if wid not in resync:
                        resync.append(wid)
            last_ids[rank] = eid
            log.remember(rank, eid, digest)
            too_big = None
            if kind == _STORED:
                if held < 0:
                    held = router.worker_blocks(wid)
                too_big = check_blocks(True, n, held)
                if too_big is not None and too_big.reason == WORKER_FULL:
                    held = router.worker_blocks(wid)
                    too_big = check_blocks(True, n, held)
                if too_big is None and budgeted:
                    bound = bounds.get(partition)
                    if bound is None or partition_full(bound, n) is not None:
                        bound = self._partition_blocks(partition)
                        too_big = partition_full(bound, n)
                    bounds[partition] = bound if too_big is not None else bound + n
            elif kind == _REMOVED:
                too_big = check_blocks(False, n, 0)
            if too_big is not None:
                self.counters[too_big.reason] += 1
                rejected.append(f"event {i} (id {eid}): {too_big}")
                continue
            reason = apply(PACKED_KINDS[kind], wid, rank, PACKED_TIERS[tier], parent, data, blocks_at, tokens_at, n)
            if reason is None:
                applied += 1
                if kind == _STORED:
                    held += n
                    log.stored = True
                announced = announced or kind != _REMOVED
            else:
                rejected.append(f"event {i} (id {eid}): {reason}")
        if not known and not announced and router.knows(wid):
            # A worker becomes a candidate by an accepted store or its `cleared` (an
            # empty cache is a real worker); rejected stores and removes of blocks it
            # never had must not make it one.
            router.unindex(wid)
        if rejected or resync:
            return Outcome("; ".join(rejected) if rejected else None, tuple(resync), applied)
        return _APPLIED[applied] if applied < len(_APPLIED) else Outcome(applied_events=applied)

    def _stale(self, wid: int, epoch: int, held: int, ts: int) -> Outcome:
        """A batch under an older epoch than the one the log accepted for its worker: a
        zombie of an old incarnation, or the live worker behind an epoch that someone
        forged ahead of it (a plausible one passes the authority). Either way the live
        worker must start an epoch above the held one: it is asked to resync (the
        request says which epoch to outrank; the replica rate-limits requests)."""
        self.counters[STALE_EPOCH] += 1
        began = self._began.get(wid)
        if began is not None and ts > began:
            self._clash(wid, epoch, held, ts)
        return Outcome(
            dlq_reason=f"{STALE_EPOCH}: epoch {epoch} < {held} (the worker is asked to resync above it)",
            resync=(wid,),
        )

    def _clash(self, wid: int, epoch: int, held: int, ts: int) -> None:
        """Record a stale batch stamped after its replacement began: the older process is
        alive. Each then outranks the other in turn (the resync request names the epoch
        to outrank), so the incarnations alternate: one clash, logged once per episode."""
        self.counters[WORKER_CLASH] += 1
        clash = self.clashes.get(wid)
        if clash is not None and ts - clash.last_ms <= CLASH_QUIET_MS:
            clash.held_epoch, clash.stale_epoch, clash.last_ms = held, epoch, ts
            clash.batches += 1
            return
        self.clashes[wid] = Clash(held, epoch, ts)
        _log.error(
            "worker id clash: two processes publish as one worker",
            worker_id=wid, held_epoch=held, stale_epoch=epoch, at=log_time(ts),
            fix="stop one of them, or give it another --worker-id",
        )

    def _displace_blockless(self, partition: int) -> bool:
        """Make room on a full partition: the worker bound there that has stored nothing
        in its epoch and was seen least recently (then the lowest id) is removed, so
        that workers that never publish blocks (phantoms) cannot crowd out real ones.
        Only the fold's state decides (``stored`` is in snapshots), so every replica
        removes the same one. False when every worker there has stored blocks."""
        heap = self._blockless.get(partition)
        while heap:
            seen, wid = heapq.heappop(heap)
            log = self.workers.get(wid)
            if log is None or log.partition != partition or log.stored:
                continue  # gone, moved, or a real worker now
            if log.last_seen_ms != seen:
                heapq.heappush(heap, (log.last_seen_ms, wid))  # seen since it was pushed
                continue
            self._drop(wid, partition, f"was displaced at {log_time(seen)} (it had stored nothing; partition {partition} was full)")
            self.counters[DISPLACED] += 1
            return True
        return False

    def _partition_blocks(self, partition: int) -> int:
        """Blocks the workers bound to ``partition`` hold (exact)."""
        router = self.router
        return sum(router.worker_blocks(w) for w, log in self.workers.items() if log.partition == partition)

    # -- leases ----------------------------------------------------------------------

    def _expire(self, partition: int, now_ms: int) -> None:
        heap = self._deadlines.get(partition)
        while heap and heap[0][0] < now_ms:
            _, wid = heapq.heappop(heap)
            log = self.workers.get(wid)
            if log is None or log.partition != partition:
                continue  # gone, or moved to another partition (its lease is there)
            deadline = log.last_seen_ms + log.lease_ms
            if deadline >= now_ms:
                heapq.heappush(heap, (deadline, wid))  # renewed since it was pushed
                continue
            # What it held on the device is expected there from then (approximate mode,
            # should it still be routed).
            self._drop(wid, partition, f"expired at {log_time(deadline)} (no event for its lease of {log.lease_ms} ms)",
                       demote_at=deadline / 1000)
            self.counters[EXPIRED] += 1

    def _drop(self, wid: int, partition: int, why: str, demote_at: float | None = None) -> None:
        """Forget a worker bound to ``partition`` (expired or displaced): its log, its slot
        in the partition's limit, and its blocks and load in the router (Router.remove_worker)."""
        del self.workers[wid]
        self._began.pop(wid, None)
        self._bound[partition] -= 1
        self.dirty.add(wid)
        if self.router.knows(wid):
            self.router.remove_worker(wid, why, demote_at)

    # -- restore from a snapshot -------------------------------------------------------

    def restore_partition(self, partition: int, next_offset: int, log_time_ms: int) -> None:
        self.partitions[partition] = PartitionState(next_offset, log_time_ms)

    def restore_worker(self, worker_id: int, log: WorkerLog) -> bool:
        """Install a worker of a snapshot; returns whether to import its blocks. A
        worker listed on two partitions (it moved while the snapshot was taken) keeps
        its greater incarnation, as the fold would."""
        old = self.workers.get(worker_id)
        if old is not None:
            if old.outranks(log.epoch, log.partition):
                return False
            self._bound[old.partition] -= 1
            if self.router.knows(worker_id):
                self.router.unindex(worker_id)
        self.workers[worker_id] = log
        self._bound[log.partition] += 1
        if not log.stored:
            heapq.heappush(self._blockless.setdefault(log.partition, []), (log.last_seen_ms, worker_id))
        heapq.heappush(
            self._deadlines.setdefault(log.partition, []), (log.last_seen_ms + log.lease_ms, worker_id)
        )
        return True

    # -- views -----------------------------------------------------------------------

    def rejections(self) -> dict[str, int]:
        """Every counter of rejected or skipped records and events: the fold's and the
        router index's (the two sets of reasons are disjoint)."""
        return dict(self.counters) | self.router.rejections()

    def next_offsets(self) -> dict[int, int]:
        return {p: s.next_offset for p, s in sorted(self.partitions.items())}
