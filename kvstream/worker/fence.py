"""A worker that another process has taken over (``kvstream worker --take-over``) stops.

The newcomer registers its own incarnation under the id on ``kvstream.workers``; the
process it replaces sees that registration on the topic and stops publishing, without
the clean stop's withdrawals: its tombstone would unregister the newcomer, and its
"cleared" would wipe the newcomer's blocks from every replica. Until it stops, the
replicas fold the two as a clash (kvstream.replica.fold.Clash), as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from kvstream.events.errors import RegistrationError
from kvstream.events.registration import Registration, RegistrationCodec
from kvstream.events.wire import worker_key
from kvstream.kafka.config import consumer_config
from kvstream.kafka.metadata import end_offsets, topic_partitions
from kvstream.logs import get_logger
from kvstream.settings import Settings
from kvstream.worker.errors import RegistryTopicError

log = get_logger(__name__)


def describe(reg: Registration) -> str:
    """One registration in words, for the worker's error line."""
    where = "no engine URL" if reg.url is None else f"engine URL {reg.url}"
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(reg.registered_at_ms / 1000))
    return f"epoch {reg.epoch}, {where}, registered at {at}"


class TakeOverWatch:
    """Follows the registry from its end as of construction (so, made before this
    worker registers, it sees every registration after), and calls ``on_taken_over``
    once with the first registration of the id that is not this worker's own."""

    def __init__(self, settings: Settings, worker_id: int, on_taken_over: Callable[[Registration], None],
                 *, timeout_s: float = 30.0) -> None:
        self._key = worker_key(worker_id)
        self._on_taken_over = on_taken_over
        self._codec = RegistrationCodec()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.successor: Registration | None = None
        topic = settings.topics.name("workers")
        self._consumer = Consumer(consumer_config(settings, **{"client.id": f"kvstream-worker-{worker_id}-fence"}))
        try:
            partitions = topic_partitions(self._consumer, topic, timeout_s)
            if not partitions:
                raise RegistryTopicError(
                    f"worker registry topic {topic} does not exist (create it with `kvstream topics create`)"
                )
            ends = end_offsets(self._consumer, topic, partitions, timeout_s)
            self._consumer.assign([TopicPartition(topic, p, end) for p, end in ends.items()])
        except KafkaException as exc:
            self._consumer.close()
            raise RegistryTopicError(f"cannot reach Kafka to watch the worker registry: {exc.args[0]}") from None
        except BaseException:
            self._consumer.close()
            raise

    def start(self, ours: Registration) -> None:
        """Watch for registrations other than ``ours`` (this worker's, once announced)."""
        self._thread = threading.Thread(target=self._run, args=(ours,), name="kvstream-fence", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        else:
            self._consumer.close()

    def _run(self, ours: Registration) -> None:
        try:
            while not self._closed.is_set():
                for msg in self._consumer.consume(100, 0.5):
                    if (err := msg.error()) is not None:
                        if err.code() != KafkaError._PARTITION_EOF:
                            log.warning("worker_fence_read_failed", error=err.str())
                        continue
                    if msg.key() == self._key and self._taken_over(msg.value(), ours):
                        return
        finally:
            self._consumer.close()

    def _taken_over(self, value: bytes | None, ours: Registration) -> bool:
        if value is None:
            # Only a clean stop writes one, and ours comes after this watch is closed.
            log.warning("worker_registration_withdrawn_by_another_process", worker_id=ours.worker_id)
            return False
        try:
            reg = self._codec.decode(value)
        except RegistrationError as exc:
            log.warning("worker_fence_unreadable_registration", worker_id=ours.worker_id, error=str(exc))
            return False
        if reg == ours:
            return False
        self.successor = reg
        log.error("worker_taken_over", worker_id=ours.worker_id, by=describe(reg))
        self._on_taken_over(reg)
        return True

