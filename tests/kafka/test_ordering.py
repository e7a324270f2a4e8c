"""Per-worker order across partitions with key = worker id (DESIGN.md §2), through the
real broker with kvstream's producer and replica-consumer settings."""

from __future__ import annotations

import random
import struct
from collections import defaultdict
from collections.abc import Callable

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from kvstream.kafka.config import consumer_config, producer_config
from kvstream.settings import Settings

pytestmark = pytest.mark.kafka

WORKERS = 64
ROUNDS = 150
PARTITIONS = 8


def _key(worker: int) -> bytes:
    return struct.pack(">Q", worker)


def test_each_workers_events_stay_in_order(kafka_topics_factory: Callable[..., Settings]) -> None:
    settings = kafka_topics_factory(events_partitions=PARTITIONS)
    topic = settings.topics.name("events")
    failures: list[KafkaError] = []

    def delivered(err: KafkaError | None, _msg: object) -> None:
        if err is not None:
            failures.append(err)

    producer = Producer(producer_config(settings))
    rng = random.Random(7)
    workers = [rng.getrandbits(64) for _ in range(WORKERS)]
    for seq in range(ROUNDS):
        # Interleave the workers differently in every round.
        for worker in rng.sample(workers, len(workers)):
            producer.produce(topic, struct.pack(">QQ", worker, seq), _key(worker), on_delivery=delivered)
        producer.poll(0)
    assert producer.flush(60) == 0
    assert failures == []

    consumer = Consumer(consumer_config(settings))
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    seen: dict[int, list[int]] = defaultdict(list)
    partitions_of: dict[int, set[int]] = defaultdict(set)
    at_end: set[int] = set()
    try:
        while len(at_end) < PARTITIONS:
            for msg in consumer.consume(1000, timeout=1.0):
                if msg.error() is not None:
                    assert msg.error().code() == KafkaError._PARTITION_EOF, msg.error()
                    at_end.add(msg.partition())
                    continue
                worker, seq = struct.unpack(">QQ", msg.value())
                assert msg.key() == _key(worker)
                seen[worker].append(seq)
                partitions_of[worker].add(msg.partition())
    finally:
        consumer.close()

    assert sorted(seen) == sorted(workers)
    for worker in workers:
        assert seen[worker] == list(range(ROUNDS)), f"worker {worker} out of order"
        assert len(partitions_of[worker]) == 1
    # 64 keys spread over all 8 partitions (the mapping is deterministic for these keys).
    assert {p for ps in partitions_of.values() for p in ps} == set(range(PARTITIONS))


def test_a_missing_offset_is_an_error_not_a_jump(kafka_topics: Settings) -> None:
    topic = kafka_topics.topics.name("events")
    producer = Producer(producer_config(kafka_topics))
    producer.produce(topic, b"x", _key(1))
    assert producer.flush(30) == 0

    consumer = Consumer(consumer_config(kafka_topics))
    # Far beyond the end of every partition, as after a topic was recreated.
    consumer.assign([TopicPartition(topic, p, 1_000_000) for p in range(4)])
    errors: list[int] = []
    try:
        for _ in range(60):
            for msg in consumer.consume(100, timeout=0.5):
                assert msg.error() is not None, "a record was delivered from a reset offset"
                errors.append(msg.error().code())
            if KafkaError._AUTO_OFFSET_RESET in errors:
                break
    finally:
        consumer.close()
    assert KafkaError._AUTO_OFFSET_RESET in errors
