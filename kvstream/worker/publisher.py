"""Publisher (DESIGN.md §2, §7): router events → Avro batches on ``kvstream.events``.

- One publisher incarnation = one epoch: a u64 taken from the wall clock in ns, and
  strictly greater than the previous one of this process (a resync starts a new one).
  Every epoch starts with ``cleared``.
- Events are stamped, merged and cut into batches by
  :class:`~kvstream.worker.batcher.EventBatcher` (ids strictly increasing per
  (worker, dp_rank) within an epoch, from 1); they wait up to ``linger_ms`` (or until a
  batch is full) to share one Kafka message, i.e. one
  :class:`~kvstream.events.model.EventBatch`.
- Key: the worker id as 8 bytes big-endian, so that all of a worker's records land on
  one partition, in order.
- The producer is idempotent with ``acks=all`` and compression
  (:func:`kvstream.kafka.config.producer_config`). Its queue is bounded; when full, the
  publisher blocks (up to ``block_timeout_s``) or fails at once, by configuration, and
  never drops a batch. A batch that Kafka finally fails to take (after librdkafka's own
  retries) is counted and then *retried as a resync*: resending the same batch would
  break the order (later ids may already be written, and readers drop stale ids), so
  the publisher starts a new epoch and publishes its full state again.
- Heartbeats: an empty batch when nothing was sent for ``heartbeat_s``.
- Resync: a :class:`ResyncRequest` on ``kvstream.control`` naming this worker (or every
  worker) makes the next :meth:`KafkaPublisher.poll` publish ``cleared`` and the full
  state of its :class:`~kvstream.worker.consolidator.StateSource` under a new epoch.

Single-threaded: the worker loop calls the writer methods, :meth:`~KafkaPublisher.poll`,
:meth:`~KafkaPublisher.flush` and :meth:`~KafkaPublisher.close` from one thread.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from kvstream.events.codec import AvroCodec, EventCodec
from kvstream.events.control import RESYNC_REQUEST as RESYNC_RECORD
from kvstream.events.control import ResyncRequest
from kvstream.events.errors import EventError
from kvstream.events.model import STATUS_HEADER, EventBatch, Tier
from kvstream.events.wire import worker_key
from kvstream.kafka.config import consumer_config, producer_config
from kvstream.kafka.metadata import end_offsets, topic_partitions
from kvstream.logs import get_logger
from kvstream.settings import Settings
from kvstream.worker.batcher import EventBatcher
from kvstream.worker.consolidator import StateSource
from kvstream.worker.options import DEFAULTS, QueueFull
from kvstream.worker.errors import (
    ControlTopicError,
    PublisherClosedError,
    PublisherQueueFullError,
)

log = get_logger(__name__)

_U64 = (1 << 64) - 1
#: A worker loop calls poll() at least this often (due_in), even when nothing is due:
#: a replica's resync request (on the control topic) and Kafka's delivery reports are
#: read there. Between, it waits for engine messages: it used to wake every linger
#: (5 ms), and an idle bridge spent 1.5 % of a core doing nothing.
HOUSEKEEPING_S = 0.1


@dataclass(frozen=True, slots=True)
class PublisherOptions:
    worker_id: int
    #: Routers keep the worker this long (log time) after its last batch.
    lease_ms: int = DEFAULTS.lease_ms
    #: An empty batch goes out when nothing else did for this long.
    heartbeat_s: float = DEFAULTS.heartbeat_s
    #: Events wait at most this long to share a Kafka message.
    linger_ms: float = DEFAULTS.linger_ms
    max_batch_events: int = 512
    #: Blocks per message; 16 bytes each on the wire, so 4096 is ~64 KiB.
    max_batch_blocks: int = 4096
    queue_full: QueueFull = DEFAULTS.queue_full
    block_timeout_s: float = 30.0
    #: Messages the producer may hold unacknowledged (librdkafka's local queue).
    queue_max_messages: int = 100_000
    #: Least time between two resyncs caused by delivery failures.
    resync_backoff_s: float = 1.0
    #: Answer resync requests from ``kvstream.control``.
    listen_control: bool = True
    #: Extra librdkafka producer settings (after kvstream's).
    producer_overrides: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.worker_id <= _U64:
            raise ValueError(f"worker_id {self.worker_id} is not a u64")
        if self.max_batch_events < 1 or self.max_batch_blocks < 1:
            raise ValueError("max_batch_events and max_batch_blocks must be positive")
        if self.heartbeat_s <= 0 or self.linger_ms < 0:
            raise ValueError("heartbeat_s must be positive and linger_ms >= 0")
        if self.lease_ms <= self.heartbeat_s * 1000:
            # Routers would drop the worker between two heartbeats.
            raise ValueError(
                f"lease_ms ({self.lease_ms}) must be longer than the heartbeat interval "
                f"({self.heartbeat_s * 1000:.0f} ms)"
            )


@dataclass(slots=True)
class PublisherStats:
    batches: int = 0  # handed to the producer (heartbeats included)
    heartbeats: int = 0
    events: int = 0  # router events handed to the producer
    blocks: int = 0  # block hashes in those events
    acked_batches: int = 0
    acked_events: int = 0
    acked_blocks: int = 0
    delivery_failures: int = 0
    queue_full_waits: int = 0
    resyncs: int = 0
    resync_requests: int = 0  # requests for this worker read from kvstream.control
    control_errors: int = 0  # undecodable control records




class ControlListener:
    """Reads ``kvstream.control`` from its end (requests older than the worker do not
    concern this incarnation) and returns the resync requests for ``worker_id``."""

    def __init__(self, settings: Settings, worker_id: int, codec: AvroCodec, timeout_s: float = 30.0) -> None:
        self._worker_id = worker_id
        self._codec = codec
        topic = settings.topics.name("control")
        self._consumer = Consumer(
            consumer_config(
                settings,
                # Never joins a group (partitions are assigned), never commits: unique.
                group_id=f"kvstream-worker-{worker_id}-{uuid.uuid4().hex}",
                **{"client.id": f"kvstream-worker-{worker_id}"},
            )
        )
        try:
            partitions = topic_partitions(self._consumer, topic, timeout_s)
            if not partitions:
                raise ControlTopicError(
                    f"control topic {topic} does not exist (create it with `kvstream topics`)"
                )
            # Start at the current end, resolved now, so that a request published after
            # this constructor returns is never missed.
            ends = end_offsets(self._consumer, topic, partitions, timeout_s)
            self._consumer.assign([TopicPartition(topic, p, end) for p, end in ends.items()])
        except KafkaException as exc:
            self._consumer.close()
            raise ControlTopicError(f"cannot read control topic {topic}: {exc.args[0]}") from exc
        except ControlTopicError:
            self._consumer.close()
            raise
        self.errors = 0

    def poll(self) -> list[ResyncRequest]:
        out: list[ResyncRequest] = []
        for msg in self._consumer.consume(num_messages=64, timeout=0):
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    self.errors += 1
                    log.warning("control_read_error", error=err.str())
                continue
            try:
                name, record = self._codec.decode(msg.value())
                if name != RESYNC_RECORD:
                    continue  # another kind of control record: not for workers
                request = ResyncRequest.from_record(record)
            except (EventError, KeyError, TypeError) as exc:
                self.errors += 1
                log.warning("control_record_undecodable", offset=msg.offset(), error=str(exc))
                continue
            if request.worker_id is None or request.worker_id == self._worker_id:
                out.append(request)
        return out

    def close(self) -> None:
        self._consumer.close()


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """An epoch and the next event id of each rank in it."""

    epoch: int
    next_ids: Mapping[int, int]


class KafkaPublisher:
    """A :class:`~kvstream.worker.consolidator.RouterEventWriter` that publishes on
    Kafka. Construction starts the first epoch (its ``cleared`` goes out with the first
    batch); :meth:`close` flushes and releases the clients."""

    def __init__(
        self,
        settings: Settings,
        options: PublisherOptions,
        *,
        codec: EventCodec | None = None,
        resume: ResumePoint | None = None,
    ) -> None:
        self.options = options
        self.worker_id = options.worker_id
        self._codec = codec or EventCodec()
        self._topic = settings.topics.name("events")
        self._key = worker_key(options.worker_id)
        self._producer = Producer(
            producer_config(
                settings,
                **{
                    "client.id": f"kvstream-worker-{options.worker_id}",
                    "queue.buffering.max.messages": options.queue_max_messages,
                    **options.producer_overrides,
                },
            )
        )
        self._control = (
            ControlListener(settings, options.worker_id, self._codec.codec) if options.listen_control else None
        )
        self.stats = PublisherStats()
        self._batcher = EventBatcher(
            options.worker_id, options.lease_ms, options.max_batch_events, options.max_batch_blocks, self._send
        )
        self._last_sent = time.monotonic()
        self._resync_reason: str | None = None
        self._last_resync = float("-inf")
        #: The greatest ``above_epoch`` of the resync requests not answered yet.
        self._resync_above = 0
        #: Why no more events are taken (closed, or a fatal producer error); None: open.
        self._stopped: str | None = None
        self._released = False
        #: Counts of engine input the worker could not apply, sent as a header
        #: (STATUS_HEADER) on every batch while non-empty; set by the worker.
        self.status: dict[str, int] = {}
        if resume is None:
            self._start_epoch()
        else:
            # The same incarnation goes on (a bridge restarted after a clean stop): no
            # ``cleared``, event ids continue where the last acknowledged batch left them.
            self._batcher.resume(resume.epoch, resume.next_ids)

    @property
    def epoch(self) -> int:
        return self._batcher.epoch

    def position(self) -> ResumePoint:
        """Where this incarnation stands, for a later :class:`ResumePoint` (exact only
        after :meth:`flush` returned 0)."""
        return ResumePoint(self.epoch, dict(self._batcher.next_ids))

    # ------------------------------------------------------------------ writer

    def stored(
        self,
        dp_rank: int,
        tier: Tier,
        parent_hash: int | None,
        block_hashes: list[int],
        tokens_hashes: list[int],
    ) -> None:
        self._check_open()
        self._batcher.stored(dp_rank, tier, parent_hash, block_hashes, tokens_hashes)

    def removed(self, dp_rank: int, tier: Tier, block_hashes: list[int]) -> None:
        self._check_open()
        self._batcher.removed(dp_rank, tier, block_hashes)

    def cleared(self, dp_rank: int, tier: Tier = Tier.DEVICE) -> None:
        self._check_open()
        self._batcher.cleared(dp_rank, tier)

    def withdraw(self) -> None:
        """Publish ``cleared`` on every tier of every rank this epoch has published, so
        that the routers drop this worker's blocks at once instead of after its lease (a
        clean stop). Sent with the next cut; :meth:`close` flushes it."""
        self._check_open()
        for rank in self._batcher.ranks():
            for tier in Tier:
                self.cleared(rank, tier)

    def _check_open(self) -> None:
        if self._stopped is not None:
            raise PublisherClosedError(f"publisher of worker {self.worker_id}: {self._stopped}")

    # ------------------------------------------------------------------ batches

    def _start_epoch(self, above: int = 0) -> None:
        # Wall-clock ns: greater than any earlier incarnation's (clocks permitting), and
        # strictly greater than this process's previous epoch whatever the clock does,
        # and than ``above`` (the epoch a resync request says the log holds).
        self._check_open()
        self._batcher.start_epoch(max(time.time_ns(), self.epoch + 1, above + 1) & _U64)

    def _cut(self) -> None:
        """Turn the pending events into one batch and hand it to the producer."""
        self._batcher.cut()

    def _send(self, batch: EventBatch, blocks: int) -> None:
        value = self._codec.encode(batch)
        n_events = len(batch.events)
        callback = partial(self._delivered, batch.epoch, n_events, blocks)
        producer = self._producer
        waited_since: float | None = None
        while True:
            try:
                headers = [(STATUS_HEADER, json.dumps(self.status).encode())] if self.status else None
                producer.produce(self._topic, value=value, key=self._key, on_delivery=callback, headers=headers)
                break
            except KafkaException as exc:
                # Refused before queueing (e.g. the topic is known not to exist): a
                # delivery failure like any other, retried the same way.
                self._delivered(batch.epoch, n_events, blocks, exc.args[0], None)
                return
            except BufferError:
                now = time.monotonic()
                if waited_since is None:
                    waited_since = now
                    self.stats.queue_full_waits += 1
                if self.options.queue_full is QueueFull.FAIL or now - waited_since >= self.options.block_timeout_s:
                    # The batch is lost to the log: what the routers know no longer
                    # matches this worker, so the next poll republishes everything.
                    self._resync_reason = "a batch was refused by a full producer queue"
                    raise PublisherQueueFullError(
                        f"producer queue full ({len(producer)} messages waiting) "
                        f"after {now - waited_since:.1f}s; batch of {n_events} events not published"
                    ) from None
                producer.poll(0.05)  # deliveries make room
        stats = self.stats
        stats.batches += 1
        stats.events += n_events
        stats.blocks += blocks
        if not n_events:
            stats.heartbeats += 1
        self._last_sent = time.monotonic()
        producer.poll(0)

    def _delivered(
        self, epoch: int, n_events: int, blocks: int, err: KafkaError | None, _msg: Message | None
    ) -> None:
        stats = self.stats
        if err is None:
            stats.acked_batches += 1
            stats.acked_events += n_events
            stats.acked_blocks += blocks
            return
        stats.delivery_failures += 1
        log.error("batch_delivery_failed", error=err.str(), events=n_events, worker_id=self.worker_id)
        if err.fatal():
            # The idempotent producer cannot go on; only a new worker incarnation can.
            self._stopped = f"fatal producer error: {err.str()}"
        if epoch == self.epoch:
            # A loss in an epoch that a resync already replaced changes nothing.
            self._resync_reason = f"delivery failed: {err.str()}"

    # ------------------------------------------------------------------ loop

    @property
    def queue_depth(self) -> int:
        """Messages in the producer not yet acknowledged."""
        return len(self._producer)

    def poll(self, state: StateSource) -> None:
        """Housekeeping, called often from the worker loop: send a batch whose linger
        expired, heartbeats, serve delivery reports, answer resync requests (and resync
        after delivery failures) with ``state``."""
        self._check_open()
        now = time.monotonic()
        batcher = self._batcher
        if batcher.pending and now - batcher.pending_since >= self.options.linger_ms / 1000:
            self._cut()
        elif now - self._last_sent >= self.options.heartbeat_s:
            if batcher.pending:
                self._cut()
            else:
                self._send(batcher.heartbeat(), 0)
        self._producer.poll(0)
        if self._control is not None:
            for req in self._control.poll():
                self.stats.resync_requests += 1
                log.info("resync_requested", requester=req.requester, reason=req.reason)
                self._resync_reason = f"requested by {req.requester}: {req.reason}"
                if req.above_epoch is not None and req.above_epoch < _U64:
                    self._resync_above = max(self._resync_above, req.above_epoch)
                self._last_resync = float("-inf")  # requests are answered at once
            self.stats.control_errors = self._control.errors
        if self._resync_reason is not None and now - self._last_resync >= self.options.resync_backoff_s:
            self.resync(state, self._resync_reason)

    def due_in(self) -> float:
        """Seconds until :meth:`poll` has work of its own (a batch's linger ends, a
        heartbeat or a resync is due, or at most HOUSEKEEPING_S: the control topic and
        Kafka's delivery reports): how long a worker loop may wait for engine messages
        before calling it."""
        o, batcher = self.options, self._batcher
        due = min(self._last_sent + o.heartbeat_s, time.monotonic() + HOUSEKEEPING_S)
        if batcher.pending:
            due = min(due, batcher.pending_since + o.linger_ms / 1000)
        if self._resync_reason is not None:
            due = min(due, self._last_resync + o.resync_backoff_s)
        return max(0.0, due - time.monotonic())

    def resync(self, state: StateSource, reason: str) -> None:
        """Publish ``cleared`` and then all of ``state`` under a new epoch."""
        self._check_open()
        self._cut()  # whatever the old epoch had pending goes out first, whole
        self._resync_reason = None
        self._last_resync = time.monotonic()
        self._start_epoch(self._resync_above)
        self._resync_above = 0
        state.replay(self)
        self._cut()
        self.stats.resyncs += 1
        log.info("resync_published", epoch=self.epoch, reason=reason, worker_id=self.worker_id)

    def flush(self, timeout_s: float = 30.0) -> int:
        """Send what is pending and wait for Kafka's acknowledgements; returns how many
        messages are still unacknowledged (0: all written)."""
        self._check_open()
        self._cut()
        return self._producer.flush(timeout_s)

    def close(self, timeout_s: float = 30.0) -> int:
        """Send what is pending, wait for it, release the clients; returns how many
        messages were left unacknowledged. Batches hold whole events only, so nothing
        partial is ever published. Idempotent."""
        if self._released:
            return 0
        try:
            if self._stopped is None:
                self._cut()
            self._stopped = "closed"
            left = self._producer.flush(timeout_s)
            if left:
                log.error("publisher_closed_with_undelivered", messages=left, worker_id=self.worker_id)
            return left
        finally:
            self._released = True
            if self._control is not None:
                self._control.close()
