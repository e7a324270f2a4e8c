"""kvstream.kafka.metadata and kvstream.kafka.producer against the real broker (and
against no broker at all: a loopback port nothing listens on)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from kvstream.kafka.config import admin_config, consumer_config, producer_config
from kvstream.kafka.metadata import end_offsets, topic_partitions, watermarks
from kvstream.kafka.producer import CountingProducer
from kvstream.settings import Settings

pytestmark = pytest.mark.kafka


def _dead_bootstrap() -> str:
    """A loopback address where no broker answers (a port bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _read_all(settings: Settings, topic: str, partitions: int) -> list[tuple[int, bytes]]:
    """(partition, value) of every record of ``topic``, read by a plain consumer."""
    c = Consumer(consumer_config(settings))
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        out: list[tuple[int, bytes]] = []
        at_end: set[int] = set()
        deadline = time.monotonic() + 30
        while len(at_end) < partitions and time.monotonic() < deadline:
            for m in c.consume(100, 0.5):
                if m.error() is None:
                    out.append((m.partition(), m.value()))
                elif m.error().code() == KafkaError._PARTITION_EOF:
                    at_end.add(m.partition())
        return out
    finally:
        c.close()


def test_partitions_and_watermarks_are_the_brokers(kafka_topics: Settings) -> None:
    topic = kafka_topics.topics.name("events")
    producer = CountingProducer(producer_config(kafka_topics, **{"linger.ms": 0}))
    for p, n in {0: 3, 2: 5}.items():
        for i in range(n):
            assert producer.produce("test", topic, value=b"%d" % i, partition=p)
    assert producer.flush(30) == 0
    assert not producer.failed and not producer.refused

    c = Consumer(consumer_config(kafka_topics))
    try:
        parts = topic_partitions(c, topic, 10)
        assert parts == (0, 1, 2, 3)  # kafka_topics: 4 event partitions
        assert topic_partitions(c, kafka_topics.topics.prefix + "no-such-topic", 10) == ()
        # Any client answers metadata requests.
        assert topic_partitions(AdminClient(admin_config(kafka_topics)), topic, 10) == parts
        got = watermarks(c, topic, parts, 10)
        assert got == {0: (0, 3), 1: (0, 0), 2: (0, 5), 3: (0, 0)}
        assert end_offsets(c, topic, parts, 10) == {0: 3, 1: 0, 2: 5, 3: 0}
    finally:
        c.close()
    # What a consumer reads agrees with the watermarks.
    read = _read_all(kafka_topics, topic, 4)
    assert sorted(p for p, _ in read) == [0] * 3 + [2] * 5


def test_watermarks_retry_until_a_topic_being_created_is_served(
    kafka_topics_factory: Callable[..., Settings],
) -> None:
    settings = kafka_topics_factory(create=False)
    topic = settings.topics.prefix + "late"
    c = Consumer(consumer_config(settings))
    try:
        # Not there yet: without retry the broker's answer is raised at once.
        with pytest.raises(KafkaException):
            watermarks(c, topic, [0, 1], 5, retry=False)
        admin = AdminClient(admin_config(settings))

        def create() -> None:
            time.sleep(1.0)
            for f in admin.create_topics([NewTopic(topic, 2, 1)]).values():
                f.result(30)

        creator = threading.Thread(target=create)
        creator.start()
        try:
            t0 = time.monotonic()
            assert watermarks(c, topic, [0, 1], 30) == {0: (0, 0), 1: (0, 0)}
            assert time.monotonic() - t0 >= 0.9  # it waited for the topic, retrying
        finally:
            creator.join()
    finally:
        c.close()


def test_watermarks_give_up_when_no_broker_answers() -> None:
    settings = Settings(bootstrap=_dead_bootstrap())
    c = Consumer(consumer_config(settings))
    try:
        t0 = time.monotonic()
        with pytest.raises(KafkaException):
            watermarks(c, "kvstream.events", [0], 1.5)
        assert time.monotonic() - t0 < 10  # within its time, not librdkafka's default
    finally:
        c.close()


def test_counting_producer_counts_when_the_broker_is_gone() -> None:
    failed: list[tuple[str, str]] = []
    producer = CountingProducer(
        producer_config(Settings(bootstrap=_dead_bootstrap()), **{"message.timeout.ms": 1000}),
        on_failed=lambda what, error: failed.append((what, error)),
    )
    assert producer.produce("dlq", "kvstream.dlq", value=b"a copy")
    assert producer.produce("resync", "kvstream.control", value=b"a request")
    assert producer.flush(20) == 0  # both reported, none raised
    assert producer.failed == {"dlq": 1, "resync": 1}
    assert sorted(failed) == [("dlq", "_MSG_TIMED_OUT"), ("resync", "_MSG_TIMED_OUT")]


def test_counting_producer_counts_what_the_client_refuses(kafka_topics: Settings) -> None:
    refused: list[tuple[str, str]] = []
    topic = kafka_topics.topics.name("dlq")
    producer = CountingProducer(
        producer_config(kafka_topics, **{"message.max.bytes": 10_000, "queue.buffering.max.messages": 2,
                                         "linger.ms": 1000}),
        on_refused=lambda what, error: refused.append((what, error)),
    )
    assert not producer.produce("dlq", topic, value=b"x" * 20_000)  # over message.max.bytes
    assert producer.produce("dlq", topic, value=b"one", poll=False)
    assert producer.produce("dlq", topic, value=b"two", poll=False)
    assert not producer.produce("tick", topic, value=b"three", poll=False)  # the queue holds two
    assert producer.flush(30) == 0
    assert refused == [("dlq", "MSG_SIZE_TOO_LARGE"), ("tick", "BufferError")]
    assert producer.refused == {("dlq", "MSG_SIZE_TOO_LARGE"): 1, ("tick", "BufferError"): 1}
    assert not producer.failed
    # Only what was accepted reached the topic, in order.
    assert [v for _, v in _read_all(kafka_topics, topic, kafka_topics.topics.dlq_partitions)] == [b"one", b"two"]


def test_a_closed_counting_producer_refuses_without_raising() -> None:
    refused: list[tuple[str, str]] = []
    producer = CountingProducer(producer_config(Settings(bootstrap=_dead_bootstrap())),
                                on_refused=lambda what, error: refused.append((what, error)))
    producer.close()
    assert not producer.produce("active", "kvstream.active", value=b"an op")
    assert producer.flush(1) == 0 and producer.poll(0) == 0
    assert refused == [("active", "closed")]
