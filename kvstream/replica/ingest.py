"""A replica's ingest thread (DESIGN.md §7): every partition of ``kvstream.events``,
``assign()``ed where the fold stands, folded under the router lock a slice at a time.

What the fold decides must go out — a DLQ copy of a record it could not apply, a
resync request, a log-clock tick — is queued in an :class:`Outbox` while the lock is
held and produced once it is released, in the order decided: routes, which wait on the
lock, never wait on a produce. The outbox is emptied before the snapshot step and when
a run ends, so a snapshot never covers a record whose DLQ copy or resync request was
not yet handed to the producer.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from kvstream.events.codec import AvroCodec
from kvstream.events.wire import key_worker
from kvstream.kafka.config import consumer_config
from kvstream.kafka.producer import CountingProducer
from kvstream.logs import get_logger
from kvstream.replica.dlq import dlq_copy
from kvstream.replica.fold import LogFold, fold_in_slices
from kvstream.replica.metrics import ReplicaMetrics
from kvstream.replica.positions import PositionCommitter, commit_callback, replica_group_id
from kvstream.replica.record import Record, read_record
from kvstream.replica.resync import ResyncRequester
from kvstream.replica.snapshotter import Snapshotter
from kvstream.replica.ticks import TickCodec, Ticker
from kvstream.settings import Settings

log = get_logger(__name__)


class Outbox:
    """Produces decided under the router lock, run after it is released, in order. One
    that raises leaves the ones after it queued for the next :meth:`send`."""

    def __init__(self) -> None:
        self._pending: deque[Callable[[], None]] = deque()

    def later(self, send: Callable[[], None]) -> None:
        self._pending.append(send)

    def send(self) -> None:
        while self._pending:
            self._pending.popleft()()


class Partitions:
    """The events topic's partitions as the replica knows them: grown by the lag
    thread's metadata check, assigned by the ingest thread. Change them under the
    router lock."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._added: list[int] = []

    def grow(self, count: int) -> list[int]:
        """Partitions ``count`` has beyond the known ones (now known, to be assigned)."""
        added = list(range(self.count, count))
        self._added.extend(added)
        self.count = max(self.count, count)
        return added

    @property
    def has_added(self) -> bool:
        return bool(self._added)

    def take_added(self) -> list[int]:
        added, self._added = self._added, []
        return added


class Ingest:
    """One replica's ingest: :meth:`run` is one run of the thread (its supervisor runs
    it again after a failure, with a fresh consumer assigned where the fold stands, so
    nothing is read twice or skipped)."""

    def __init__(
        self,
        replica_id: str,
        settings: Settings,
        lock: AbstractContextManager[Any],
        fold: LogFold,
        partitions: Partitions,
        positions: Callable[[], dict[int, int]],
        producer: CountingProducer,
        resync: ResyncRequester,
        metrics: ReplicaMetrics,
        stop: threading.Event,
        progress: Callable[[], None],
        broker_down: Callable[[], bool],
        *,
        snapshotter: Snapshotter | None,
        worker_status: dict[int, dict],
        codec: AvroCodec,
        consume_batch: int,
        tick_interval_s: float,
        commit_interval_s: float,
        dlq_max_bytes: int,
    ) -> None:
        self.replica_id = replica_id
        self._settings = settings
        self._topic = settings.topics.name("events")
        self._dlq_topic = settings.topics.name("dlq")
        self._lock = lock
        self._fold = fold
        self._partitions = partitions
        self._positions = positions
        self._producer = producer
        self._resync = resync
        self._metrics = metrics
        self._stop = stop
        self._progress = progress
        self._broker_down = broker_down
        self._snapshotter = snapshotter
        #: worker id → its engine issues, from the newest STATUS_HEADER seen.
        self._worker_status = worker_status
        self._consume_batch = consume_batch
        self._commit_interval_s = commit_interval_s
        self._dlq_max_bytes = dlq_max_bytes
        self._outbox = Outbox()
        self._ticker = Ticker(replica_id, tick_interval_s, self._queue_tick, TickCodec(codec))

    def run(self) -> None:
        consumer = Consumer(
            consumer_config(self._settings, group_id=replica_group_id(self.replica_id),
                            on_commit=commit_callback(self._commit_failed))
        )
        committer = PositionCommitter(consumer, self._topic, self._commit_interval_s, self._commit_failed)
        try:
            with self._lock:
                at = self._positions()
                self._partitions.take_added()  # assigned below with the others
                count = self._partitions.count
            consumer.assign([TopicPartition(self._topic, p, at.get(p, OFFSET_BEGINNING)) for p in range(count)])
            while not self._stop.is_set():
                if self._partitions.has_added:
                    self._assign_added(consumer)
                # Wait for one record, then take what is already there: low lag when
                # quiet, large batches under load.
                msgs = consumer.consume(1, 0.05)
                if msgs:
                    msgs += consumer.consume(self._consume_batch - 1, 0)
                    try:
                        fold_in_slices(self._lock, msgs, self._apply)
                    finally:
                        self._outbox.send()
                # The lock only when there is work: a route on the event loop waits for
                # it meanwhile (kvstream.replica.loop_lock).
                if self._snapshotter is not None and self._snapshotter.pending():
                    with self._lock:
                        self._snapshotter.step()
                self._housekeeping(committer)
                self._progress()
        finally:
            self._outbox.send()
            if not self._broker_down():
                committer.final(self._positions())
            consumer.close()

    def _assign_added(self, consumer: Consumer) -> None:
        with self._lock:
            added = self._partitions.take_added()
        # From their start: a new partition holds only records written since it was added.
        consumer.incremental_assign([TopicPartition(self._topic, p, OFFSET_BEGINNING) for p in added])
        log.info("partitions added", replica=self.replica_id, partitions=added)

    def _commit_failed(self, error: str) -> None:
        self._metrics.commit_failures.inc()
        log.warning("position commit failed", replica=self.replica_id, error=error)

    def _apply(self, msgs: list) -> None:
        """Fold ``msgs`` (under the router lock); what must go out goes to the outbox."""
        fold = self._fold
        applied = 0
        records = 0
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    self._metrics.consume_errors.inc()
                    log.warning("consume error", error=str(err))
                continue
            records += 1
            record = read_record(m)
            if record.status is not None:
                self._note_worker_status(record)
            out = fold.apply(record)
            applied += out.applied_events
            if out.dlq_reason is not None:
                self._outbox.later(partial(self._to_dlq, m, out.dlq_reason, record.problem is not None))
            for wid in out.resync:
                resync = self._resync.asked(m.partition(), m.offset(), wid, out.dlq_reason, fold.workers.get(wid))
                if resync is not None:
                    self._outbox.later(partial(self._resync.request, resync))
        self._metrics.events_applied.inc(applied)
        self._metrics.records.inc(records)
        if self._snapshotter is not None and records:
            self._snapshotter.records_applied(records)

    def _note_worker_status(self, record: Record) -> None:
        """A worker's engine issues (STATUS_HEADER), shown by /v1/workers."""
        if (wid := key_worker(record.key)) is not None:
            self._worker_status[wid] = dict(record.status or {})

    def _to_dlq(self, m: Any, reason: str, by_reference: bool) -> None:
        self._metrics.dlq.inc()
        copy = dlq_copy(m, reason, by_reference=by_reference, max_bytes=self._dlq_max_bytes)
        if copy.referenced:
            self._metrics.dlq_referenced.inc()
        self._producer.produce("dlq", self._dlq_topic, value=copy.value, key=copy.key, headers=copy.headers)

    def _housekeeping(self, committer: PositionCommitter) -> None:
        if self._resync.deferring:
            with self._lock:
                due = self._resync.unhealed(self._positions(), self._fold.workers)
            for resync in due:
                self._resync.request(resync)
        if self._ticker.due():
            with self._lock:
                self._ticker.step(self._fold)
        self._outbox.send()
        committer.step(self._positions)
        self._producer.poll(0)

    def _queue_tick(self, partition: int, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        self._outbox.later(partial(self._produce_tick, partition, key, value, headers))

    def _produce_tick(self, partition: int, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        self._metrics.ticks.inc()
        self._producer.produce("tick", self._topic, value=value, key=key, partition=partition, headers=headers)
