"""The reference of the fold's decisions: :class:`ModelFold` folds each record over the
model objects, decoded the generic way (strict walk, fastavro, the model's checks), with
the Python digest (tests/events/digest.py) and the index's apply of model events
(``Router.apply_event``). It shares the production fold's state and the rules that do
not look at a batch's events (stale and clashing incarnations, displacement, leases),
and writes out on its own every rule that does: new incarnations, duplicates, gaps,
reused ids, the authority's limits (the partition's blocks counted exactly where the
fold keeps a bound), what makes a worker a candidate. Nothing of the compiled reader,
the packed form or ``apply_packed`` is in it: tests/replica/test_fold_paths.py checks
that the production fold decides as it does."""

from __future__ import annotations

import heapq

from kvstream.events.codec import EventCodec
from kvstream.events.errors import DecodeError
from kvstream.events.model import Cleared, EventBatch, Removed, Stored
from kvstream.replica.authority import TRUSTING, WORKER_FULL, LogAuthority
from kvstream.replica.fold import (
    DECODE_ERROR, DUPLICATE, GAP, ID_CONFLICT, NO_CLEARED, WRONG_PARTITION, LogFold, Outcome, PartitionState,
    WorkerLog,
)
from kvstream.router import Router

from tests.events.digest import event_digest


class ModelFold(LogFold):
    def __init__(self, router: Router, codec: EventCodec, authority: LogAuthority = TRUSTING) -> None:
        super().__init__(router, codec, authority)
        self._decode = codec._decode_generic

    def _apply_record(
        self, partition: int, offset: int, timestamp_ms: int, value: bytes | None, is_tick: bool, key: bytes | None
    ) -> Outcome:
        part = self.partitions.setdefault(partition, PartitionState())
        part.next_offset = offset + 1
        part.log_time_ms = max(part.log_time_ms, timestamp_ms)
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
        rejected = self.authority.check_head(key, timestamp_ms, batch.worker_id, batch.epoch, batch.lease_ms)
        if rejected is not None:
            self.counters[rejected.reason] += 1
            outcome = Outcome(dlq_reason=str(rejected))
        else:
            outcome = self._apply_model_batch(partition, timestamp_ms, batch)
        self._expire(partition, part.log_time_ms)
        return outcome

    def _apply_model_batch(self, partition: int, ts: int, batch: EventBatch) -> Outcome:
        wid = batch.worker_id
        log = self.workers.get(wid)
        resync: list[int] = []
        if log is not None and log.outranks(batch.epoch, partition):
            if batch.epoch < log.epoch:
                return self._stale(wid, batch.epoch, log.epoch, ts)
            self.counters[WRONG_PARTITION] += 1
            return Outcome(
                dlq_reason=f"{WRONG_PARTITION}: worker {wid} epoch {batch.epoch} is bound to partition "
                f"{log.partition}, not {partition} (a worker starts a new epoch after partitions are added)",
                resync=(wid,),
            )
        if log is None or log.epoch != batch.epoch or log.partition != partition:
            if log is None or log.partition != partition:
                full = self.authority.partition_full(self._bound[partition])
                if full is not None and not self._displace_blockless(partition):
                    self.counters[full.reason] += 1
                    return Outcome(dlq_reason=str(full))
                heapq.heappush(self._deadlines.setdefault(partition, []), (ts + batch.lease_ms, wid))
                self._bound[partition] += 1
            if log is not None:
                self.router.clear_worker(wid)
                if log.partition != partition:
                    self._bound[log.partition] -= 1
            log = self.workers[wid] = WorkerLog(partition, batch.epoch, batch.lease_ms, ts)
            self._began[wid] = ts
            heapq.heappush(self._blockless.setdefault(partition, []), (ts, wid))
            if batch.events and type(batch.events[0]) is not Cleared:
                self.counters[NO_CLEARED] += 1
                resync.append(wid)
        self.dirty.add(wid)
        log.lease_ms = batch.lease_ms
        log.last_seen_ms = max(log.last_seen_ms, ts)
        rejected: list[str] = []
        applied = 0
        router = self.router
        known = router.knows(wid)
        announced = False
        check_blocks = self.authority.check_blocks
        held = router.worker_blocks(wid)  # exact at the start, then stores added
        for i, ev in enumerate(batch.events):
            digest = event_digest(ev)
            last = log.last_ids.get(ev.dp_rank)
            if last is not None:
                if ev.event_id <= last:
                    if log.conflicts(ev.dp_rank, ev.event_id, digest):
                        self.counters[ID_CONFLICT] += 1
                        rejected.append(f"event {i} (id {ev.event_id}): {ID_CONFLICT}")
                        if wid not in resync:
                            resync.append(wid)
                    else:
                        self.counters[DUPLICATE] += 1
                    continue
                if ev.event_id != last + 1:
                    self.counters[GAP] += 1
                    if wid not in resync:
                        resync.append(wid)
            log.last_ids[ev.dp_rank] = ev.event_id
            log.remember(ev.dp_rank, ev.event_id, digest)
            too_big = None if type(ev) is Cleared else check_blocks(type(ev) is Stored, len(ev.block_hashes), held)
            if too_big is not None and too_big.reason == WORKER_FULL:
                held = router.worker_blocks(wid)
                too_big = check_blocks(True, len(ev.block_hashes), held)
            if too_big is None and type(ev) is Stored:
                # Counted exactly each time (the fold keeps an upper bound).
                too_big = self.authority.partition_blocks_full(self._partition_blocks(partition), len(ev.block_hashes))
            if too_big is not None:
                self.counters[too_big.reason] += 1
                rejected.append(f"event {i} (id {ev.event_id}): {too_big}")
                continue
            reason = router.apply_event(ev)
            if reason is None:
                applied += 1
                if type(ev) is Stored:
                    held += len(ev.block_hashes)
                    log.stored = True
                announced = announced or type(ev) is not Removed
            else:
                rejected.append(f"event {i} (id {ev.event_id}): {reason}")
        if not known and not announced and router.knows(wid):
            router.unindex(wid)
        return Outcome("; ".join(rejected) if rejected else None, tuple(resync), applied)
