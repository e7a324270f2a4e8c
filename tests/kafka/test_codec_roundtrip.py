"""EventBatches through a real broker: encoded by EventCodec, keyed by worker id, read back
from every partition, decoded equal and in per-worker order."""

from __future__ import annotations

import random
import time
from collections import defaultdict

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from kvstream.events.codec import EventCodec
from kvstream.events.model import U64_MAX, Cleared, EventBatch, Removed, Stored, Tier
from kvstream.kafka.config import consumer_config, producer_config
from kvstream.settings import Settings

WORKERS = [0, 1, 2, U64_MAX, 1 << 63, 0x1234_5678_9ABC_DEF0]
BATCHES_PER_WORKER = 25


def worker_batches(worker: int, rng: random.Random) -> list[EventBatch]:
    out = []
    event_id = 0
    for b in range(BATCHES_PER_WORKER):
        events = []
        for _ in range(rng.randrange(0, 6)):
            event_id += 1
            roll = rng.random()
            tier = rng.choice(list(Tier))
            if roll < 0.7:
                n = rng.randrange(1, 17)
                events.append(
                    Stored(
                        worker,
                        rng.randrange(4),
                        tier,
                        7,
                        event_id,
                        rng.choice([None, rng.getrandbits(64)]),
                        tuple(rng.getrandbits(64) for _ in range(n)),
                        tuple(rng.getrandbits(64) for _ in range(n)),
                    )
                )
            elif roll < 0.95:
                events.append(Removed(worker, 0, tier, 7, event_id, (rng.getrandbits(64), U64_MAX)))
            else:
                events.append(Cleared(worker, 0, tier, 7, event_id))
        out.append(EventBatch(worker, 7, 1000 + b, tuple(events)))
    return out


def test_event_batches_through_kafka(kafka_topics: Settings) -> None:
    codec = EventCodec()
    topic = kafka_topics.topics.name("events")
    rng = random.Random(11)
    sent = {w: worker_batches(w, rng) for w in WORKERS}

    failures: list[KafkaError] = []
    producer = Producer(producer_config(kafka_topics))
    # Interleave workers, as a shared topic sees them.
    for b in range(BATCHES_PER_WORKER):
        for w in WORKERS:
            producer.produce(
                topic,
                value=codec.encode(sent[w][b]),
                key=w.to_bytes(8, "big"),
                on_delivery=lambda err, _msg: failures.append(err) if err else None,
            )
        producer.poll(0)
    assert producer.flush(30) == 0
    assert failures == []

    consumer = Consumer(consumer_config(kafka_topics))
    partitions = list(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
    assert len(partitions) == 4
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    received: dict[int, list[EventBatch]] = defaultdict(list)
    partition_of: dict[int, set[int]] = defaultdict(set)
    at_eof: set[int] = set()
    deadline = time.monotonic() + 60
    try:
        while len(at_eof) < len(partitions) and time.monotonic() < deadline:
            for msg in consumer.consume(500, timeout=1.0):
                err = msg.error()
                if err is not None:
                    assert err.code() == KafkaError._PARTITION_EOF, err
                    at_eof.add(msg.partition())
                    continue
                batch = codec.decode(msg.value())
                assert msg.key() == batch.worker_id.to_bytes(8, "big")
                received[batch.worker_id].append(batch)
                partition_of[batch.worker_id].add(msg.partition())
    finally:
        consumer.close()

    assert at_eof == set(partitions), "did not reach the end of every partition in time"
    assert dict(received) == sent  # every batch, decoded equal, in per-worker order
    assert all(len(ps) == 1 for ps in partition_of.values())  # one worker, one partition
