"""A worker's registration on ``kvstream.workers`` (kvstream.events.registration): put once
when the worker starts, withdrawn by a tombstone when it stops cleanly.

Announced once, not periodically: the topic is compacted, so the last registration of a
worker stays on it (and in every replica's fold) for as long as the worker does not
withdraw it; re-announcing would only write copies that compaction deletes. Whether the
worker is *alive* is not the registry's business: the lease of its batches on
``kvstream.events`` says that (a worker that crashed leaves its registration, and the
routers drop it from the candidates when its lease runs out); a restart announces again,
with its new epoch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from confluent_kafka import KafkaError, KafkaException, Producer

from kvstream.events.errors import RegistrationError
from kvstream.events.registration import Registration, RegistrationCodec
from kvstream.events.wire import worker_key
from kvstream.kafka.config import producer_config
from kvstream.kafka.metadata import topic_partitions
from kvstream.logs import get_logger
from kvstream.settings import Settings
from kvstream.worker.errors import RegistryTopicError

log = get_logger(__name__)


class WorkerAnnouncer:
    """Writes one worker's registration and its tombstone, each acknowledged by Kafka."""

    def __init__(self, settings: Settings, registration: Registration, *, timeout_s: float = 30.0) -> None:
        self.registration = registration
        self._timeout_s = timeout_s
        self._topic = settings.topics.name("workers")
        self._key = worker_key(registration.worker_id)
        self._codec = RegistrationCodec()
        self._producer = Producer(
            producer_config(settings, **{"client.id": f"kvstream-worker-{registration.worker_id}-registry", "linger.ms": 0})
        )
        self.announced = False

    def announce(self) -> None:
        """Put the registration on the topic; RegistryTopicError when Kafka does not take it."""
        try:
            partitions = topic_partitions(self._producer, self._topic, self._timeout_s)
        except KafkaException as exc:
            raise RegistryTopicError(f"cannot reach Kafka to register the worker: {exc.args[0]}") from None
        if not partitions:
            raise RegistryTopicError(
                f"worker registry topic {self._topic} does not exist (create it with `kvstream topics create`)"
            )
        try:
            value = self._codec.encode(self.registration)
        except RegistrationError as exc:
            raise RegistryTopicError(f"cannot encode the registration: {exc}") from None
        self._put(value, "registration")
        self.announced = True
        reg = self.registration
        log.info(
            "worker_registered", worker_id=reg.worker_id, url=reg.url, models=list(reg.models),
            loras=list(reg.loras), epoch=reg.epoch,
        )

    def withdraw(self) -> None:
        """Put the tombstone (only after a registration this process made)."""
        if not self.announced:
            return
        self._put(None, "tombstone")
        self.announced = False
        log.info("worker_unregistered", worker_id=self.registration.worker_id)

    def _put(self, value: bytes | None, what: str) -> None:
        errors: list[KafkaError] = []
        try:
            self._producer.produce(
                self._topic, key=self._key, value=value, timestamp=int(time.time() * 1000),
                on_delivery=lambda err, _msg: errors.append(err) if err else None,
            )
        except (KafkaException, BufferError) as exc:
            raise RegistryTopicError(f"worker {what} refused: {exc}") from None
        left = self._producer.flush(self._timeout_s)
        if left or errors:
            raise RegistryTopicError(
                f"worker {what} not acknowledged by Kafka: {errors[0].str() if errors else 'timed out'}"
            )

    def close(self) -> None:
        self._producer.flush(1.0)


def register_synthetic(settings: Settings, worker_ids: Iterable[int], block_size: int = 16, timeout_s: float = 30.0) -> None:
    """Register workers that have no engine URL (synthetic logs of benchmarks and tests),
    as ``kvstream worker --engine synthetic`` does, so that the routers admit them
    (kvstream.replica.admission); RegistryTopicError when Kafka does not take them all."""
    codec = RegistrationCodec()
    topic = settings.topics.name("workers")
    producer = Producer(producer_config(settings, **{"linger.ms": 5}))
    errors: list[KafkaError] = []
    now = int(time.time() * 1000)
    try:
        for wid in dict.fromkeys(worker_ids):
            reg = Registration(wid, None, (), (), block_size, (0,), "synthetic", None, 0, now)
            producer.produce(topic, key=worker_key(wid), value=codec.encode(reg), timestamp=now,
                             on_delivery=lambda err, _msg: errors.append(err) if err else None)
            producer.poll(0)
    except (KafkaException, BufferError) as exc:
        raise RegistryTopicError(f"worker registration refused: {exc}") from None
    if producer.flush(timeout_s) or errors:
        raise RegistryTopicError(
            f"worker registrations not acknowledged by Kafka: {errors[0].str() if errors else 'timed out'}"
        )
