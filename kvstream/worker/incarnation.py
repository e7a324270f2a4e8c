"""Whether a worker id is already taken by a live process, looked up by a worker before
it starts (two processes with one id would each replace the other's cache in the
routers, in turn).

Live means: the id's last record on ``kvstream.workers`` is not a tombstone (a cleanly
stopped worker writes one), its newest record on ``kvstream.events`` is within its own
lease of now, and another one follows it within two heartbeat intervals (this worker's
``heartbeat_s``: a fleet shares its settings; an idle worker sends a heartbeat that
often): a worker restarted at once after a crash waits a few seconds to see its old
incarnation stay silent, instead of being refused. One whose heartbeats are further
apart than that can go unseen here, and is then reported by the replicas as a clash
(kvstream.replica.fold.Clash). Only the id's own partition is read, back to the longest
lease a batch may carry, so the look-up costs one partition's last seconds whatever the
log's size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from confluent_kafka import (
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from kvstream.events.codec import EventCodec
from kvstream.events.errors import DecodeError, RegistrationError
from kvstream.events.model import EventBatch
from kvstream.events.registration import Registration, RegistrationCodec
from kvstream.events.wire import worker_key
from kvstream.kafka.config import consumer_config
from kvstream.kafka.metadata import end_offsets, topic_partitions, watermarks
from kvstream.settings import Settings
from kvstream.worker.errors import RegistryTopicError

#: How far back the events partition is read when the settings bound no lease (ms).
DEFAULT_LOOKBACK_MS = 60_000
#: Added to two heartbeat intervals for a record's way through Kafka (s).
HEARTBEAT_SLACK_S = 1.0
_CODEC = EventCodec()


@dataclass(frozen=True, slots=True)
class Incarnation:
    """A process publishing as a worker id."""

    worker_id: int
    epoch: int
    #: Wall-clock ms of its newest record, and the lease that record carries.
    last_seen_ms: int
    lease_ms: int
    #: Its registration on kvstream.workers (None: it registered none).
    registration: Registration | None

    def describe(self) -> str:
        reg = self.registration
        where = "no engine URL" if reg is None or reg.url is None else f"engine URL {reg.url}"
        since = "" if reg is None else f", registered at {_iso(reg.registered_at_ms)}"
        ago = max(0.0, time.time() - self.last_seen_ms / 1000)
        return f"worker {self.worker_id}: epoch {self.epoch}, {where}{since}, last heard {ago:.1f}s ago"


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


def kafka_partition(key: bytes, partitions: int) -> int:
    """The partition the producers' ``murmur2_random`` partitioner puts ``key`` on
    (Kafka's murmur2, as its Java client computes it)."""
    m, h = 0x5BD1E995, (0x9747B28C ^ len(key)) & 0xFFFFFFFF
    whole = len(key) & ~3
    for i in range(0, whole, 4):
        k = (int.from_bytes(key[i : i + 4], "little") * m) & 0xFFFFFFFF
        k = ((k ^ (k >> 24)) * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail = key[whole:]
    if tail:
        for i in reversed(range(len(tail))):
            h ^= tail[i] << (8 * i)
        h = (h * m) & 0xFFFFFFFF
    h = ((h ^ (h >> 13)) * m) & 0xFFFFFFFF
    h ^= h >> 15
    return (h & 0x7FFFFFFF) % partitions


def live_incarnation(
    settings: Settings,
    worker_id: int,
    on_wait: Callable[[Incarnation, float], None] = lambda _, __: None,
    timeout_s: float = 30.0,
) -> Incarnation | None:
    """The live process publishing as ``worker_id``, or None; ``on_wait`` is told of an
    incarnation heard within its lease, and how long (s) we wait to hear it again.
    RegistryTopicError when Kafka cannot be read."""
    key = worker_key(worker_id)
    consumer = Consumer(consumer_config(settings, **{"enable.partition.eof": True}))
    try:
        withdrawn, reg = _registration(consumer, settings.topics.name("workers"), key, timeout_s)
        if withdrawn:
            return None  # a clean stop, whose last batches may still be within their lease
        found = _newest_batch(consumer, settings, key, timeout_s)
        if found is None:
            return None
        (epoch, lease_ms, ts), tp = found
        if ts + lease_ms < time.time() * 1000:
            return None
        # Until the end of its lease or two heartbeats after its newest record, whichever
        # comes first: a live process publishes again by then.
        quiet_s = min(lease_ms / 1000, 2 * settings.worker.heartbeat_s + HEARTBEAT_SLACK_S)
        wait_s = max(0.0, ts / 1000 + quiet_s - time.time())
        on_wait(Incarnation(worker_id, epoch, ts, lease_ms, reg), wait_s)
        until = time.monotonic() + wait_s
        for msg in _follow(consumer, tp, until):
            if msg.key() == key and msg.timestamp()[1] > ts and (batch := _decode(msg)) is not None:
                return Incarnation(worker_id, batch.epoch, msg.timestamp()[1], batch.lease_ms, reg)
        return None
    except KafkaException as exc:
        raise RegistryTopicError(f"cannot look for another worker {worker_id} on Kafka: {exc.args[0]}") from None
    finally:
        consumer.close()


def _decode(msg: Message) -> EventBatch | None:
    try:
        return _CODEC.decode(msg.value()) if msg.value() is not None else None
    except DecodeError:
        return None


def _follow(consumer: Consumer, tp: TopicPartition, until: float) -> Iterator[Message]:
    """Messages of one partition from ``tp.offset`` on, until the monotonic ``until``."""
    consumer.assign([tp])
    while (left := until - time.monotonic()) > 0:
        for msg in consumer.consume(500, min(left, 0.2)):
            err = msg.error()
            if err is None:
                yield msg
            elif err.code() != KafkaError._PARTITION_EOF:
                raise KafkaException(err)


def _read_to_end(consumer: Consumer, tp: TopicPartition, end: int, timeout_s: float) -> Iterator[Message]:
    """Messages of one partition from ``tp.offset`` up to ``end`` (exclusive)."""
    consumer.assign([tp])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for msg in consumer.consume(500, 0.2):
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    return
                raise KafkaException(err)
            yield msg
            if msg.offset() + 1 >= end:
                return
    raise KafkaException(KafkaError(KafkaError._TIMED_OUT, f"reading {tp.topic} timed out"))


def _newest_batch(
    consumer: Consumer, settings: Settings, key: bytes, timeout_s: float
) -> tuple[tuple[int, int, int], TopicPartition] | None:
    """(epoch, lease ms, timestamp ms) of the newest batch keyed ``key`` within the
    lookback, and its partition at the end it had when read."""
    topic = settings.topics.name("events")
    partitions = topic_partitions(consumer, topic, timeout_s)
    if not partitions:
        return None  # no topic: nobody publishes (the publisher says what is missing)
    p = kafka_partition(key, len(partitions))
    since = int(time.time() * 1000) - (settings.fold.max_lease_ms or DEFAULT_LOOKBACK_MS)
    start = consumer.offsets_for_times([TopicPartition(topic, p, since)], timeout=timeout_s)[0].offset
    end = end_offsets(consumer, topic, [p], timeout_s)[p]
    if start < 0 or start == OFFSET_END or start >= end:
        return None
    newest: tuple[int, int, int] | None = None
    for msg in _read_to_end(consumer, TopicPartition(topic, p, start), end, timeout_s):
        if msg.key() != key or (batch := _decode(msg)) is None:
            continue
        ts = msg.timestamp()[1]
        if newest is None or ts >= newest[2]:
            newest = (batch.epoch, batch.lease_ms, ts)
    return None if newest is None else (newest, TopicPartition(topic, p, end))


def _registration(consumer: Consumer, topic: str, key: bytes, timeout_s: float) -> tuple[bool, Registration | None]:
    """(whether the id's last record on the registry is a tombstone, its last
    registration)."""
    partitions = topic_partitions(consumer, topic, timeout_s)
    if not partitions:
        return False, None
    withdrawn, reg = False, None
    codec = RegistrationCodec()
    for p, (low, end) in watermarks(consumer, topic, partitions, timeout_s).items():
        if low >= end:
            continue
        for msg in _read_to_end(consumer, TopicPartition(topic, p, low), end, timeout_s):
            if msg.key() != key:
                continue
            withdrawn = msg.value() is None
            try:
                reg = None if withdrawn else codec.decode(msg.value())
            except RegistrationError:
                reg = None
    return withdrawn, reg
