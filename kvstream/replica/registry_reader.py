"""The worker registry thread: ``kvstream.workers`` folded into the replica's
:class:`~kvstream.replica.registry.WorkerRegistry` (who may win a route, the gateway's
worker directory): the whole compacted topic from its start, then what follows. A
restarted run resumes where the last one left."""

from __future__ import annotations

import threading
from collections.abc import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from kvstream.kafka.config import consumer_config
from kvstream.kafka.metadata import end_offsets, topic_partitions
from kvstream.logs import get_logger
from kvstream.replica.metrics import ReplicaMetrics
from kvstream.replica.registry import WorkerRegistry
from kvstream.settings import Settings

log = get_logger(__name__)


class RegistryReader:
    """:meth:`run` is the thread; :attr:`loaded` is set once the topic's end as it was
    at start has been read (or when the topic is missing: routing works without it)."""

    def __init__(
        self,
        settings: Settings,
        replica_id: str,
        registry: WorkerRegistry,
        metrics: ReplicaMetrics,
        stop: threading.Event,
        progress: Callable[[], None],
    ) -> None:
        self._settings = settings
        self._topic = settings.topics.name("workers")
        self.replica_id = replica_id
        self._registry = registry
        self._metrics = metrics
        self._stop = stop
        self._progress = progress
        self._next: dict[int, int] = {}
        self.loaded = threading.Event()

    def run(self) -> None:
        topic = self._topic
        consumer = Consumer(consumer_config(self._settings))
        try:
            while not self._stop.is_set():
                parts = topic_partitions(consumer, topic, 30)
                if parts:
                    break
                # Not ready-blocking: /v1/route works without it; the gateway has no workers.
                self.loaded.set()
                log.error("worker registry topic missing; create it with `kvstream topics create`", topic=topic)
                self._stop.wait(10)
            else:
                return
            ends = end_offsets(consumer, topic, parts, 30)
            consumer.assign([TopicPartition(topic, p, self._next.get(p, OFFSET_BEGINNING)) for p in parts])
            while not self._stop.is_set():
                # Wait for one record, then take what is already there: consume(500, t)
                # waits the whole t for a short topic, and the replica is not ready
                # until the registry is loaded (a partition's end comes as an EOF event).
                msgs = consumer.consume(1, 0.1)
                if msgs:
                    msgs += consumer.consume(499, 0)
                for m in msgs:
                    if m.error() is not None:
                        if m.error().code() != KafkaError._PARTITION_EOF:
                            self._metrics.consume_errors.inc()
                        continue
                    self._apply(m)
                    self._next[m.partition()] = m.offset() + 1
                if not self.loaded.is_set() and all(
                    self._next.get(p, 0) >= end or consumer.position([TopicPartition(topic, p)])[0].offset >= end
                    for p, end in ends.items()
                ):
                    self.loaded.set()
                    log.info("worker registry loaded", replica=self.replica_id,
                             workers=len(self._registry.registrations()))
                self._progress()
        finally:
            consumer.close()

    def _apply(self, m) -> None:
        """One record of the workers topic; a bad one is counted and skipped."""
        reason = self._registry.apply(m.key(), m.value())
        if reason is None:
            self._metrics.registry_records.inc()
            self._metrics.registered_workers.set(len(self._registry.registrations()))
            return
        self._metrics.registry_skipped.labels(reason=reason).inc()
        if reason != "unknown_tombstone":
            log.warning("worker registration skipped", reason=reason, partition=m.partition(), offset=m.offset())
