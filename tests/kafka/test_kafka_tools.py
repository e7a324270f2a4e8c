"""kvstream's topics through Kafka's own command-line tools (org.apache.kafka:kafka-tools
4.1.1, run by ``ops/kafka/broker.sh tool``): what an operator's standard tooling sees
of a log written by real workers and replicas."""

from __future__ import annotations

import re
import time
import uuid

import pytest
from confluent_kafka import Consumer, TopicPartition

from kvstream.events.model import Tier
from kvstream.hashing import local_hashes
from kvstream.kafka.config import consumer_config
from kvstream.replica.positions import replica_group_id
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.settings import Settings
from kvstream.worker.consolidator import Consolidator, Mode
from kvstream.worker.publisher import KafkaPublisher, PublisherOptions
from kvstream.worker.source_events import SourceStored

from tests.kafka.nodes import run_tool
from tests.replica.test_replica_kafka import high_watermarks, log_records, produce, start, wait_caught_up

pytestmark = pytest.mark.kafka

LONG = "org.apache.kafka.common.serialization.LongDeserializer"
TOKENS = local_hashes(list(range(16 * 8)), 16)


def worker(settings: Settings, wid: int, lease_ms: int) -> tuple[KafkaPublisher, Consolidator]:
    pub = KafkaPublisher(
        settings, PublisherOptions(worker_id=wid, lease_ms=lease_ms, heartbeat_s=0.3, linger_ms=5, listen_control=False)
    )
    return pub, Consolidator(pub, Mode.DEDUP)


def run_for(seconds: float, *workers: tuple[KafkaPublisher, Consolidator]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for pub, cons in workers:
            pub.poll(cons)
        time.sleep(0.02)


def until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_console_consumer_reads_the_whole_events_topic(kafka_topics: Settings) -> None:
    """Workers (stores, heartbeats), one that dies without ``cleared`` (so replicas tick
    its partition), two replicas: Kafka's console consumer with a long key deserializer
    reads every record and exits cleanly."""
    replicas = [Replica(kafka_topics, ReplicaOptions(tick_interval_s=0.2)) for _ in range(2)]
    for r in replicas:
        r.start()
    live, dying = worker(kafka_topics, 7, 60_000), worker(kafka_topics, 8, 1000)
    try:
        for n, (pub, cons) in enumerate((live, dying)):
            cons.on_source_event(SourceStored(Tier.DEVICE, 0, None, tuple(range(100 * n, 100 * n + 8)), tuple(TOKENS)))
        run_for(1.0, live, dying)
        assert dying[0].close() == 0  # dies: no cleared, no more heartbeats
        until(lambda: all(not r.router.knows(8) for r in replicas), "worker 8's lease to expire")
        run_for(0.5, live)
        assert live[0].close() == 0
        for r in replicas:
            wait_caught_up(r, kafka_topics)
        ticks = sum(r.metrics.ticks._value.get() for r in replicas)
        assert ticks >= 1
    finally:
        for r in replicas:
            r.stop()
    topic = kafka_topics.topics.name("events")
    total = sum(high_watermarks(kafka_topics).values())
    out = run_tool(
        "console-consumer", "--bootstrap-server", kafka_topics.bootstrap, "--topic", topic,
        "--from-beginning", "--max-messages", str(total), "--timeout-ms", "60000",
        "--key-deserializer", LONG,
        "--property", "print.key=true", "--property", "print.partition=true",
        "--property", "print.offset=true", "--property", "print.headers=true",
        "--property", "print.value=false",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"Processed a total of {total} messages" in out.stderr, out.stderr[-3000:]
    assert "ERROR" not in out.stderr, out.stderr[-3000:]
    rows = [re.fullmatch(r"Partition:(\d+)\tOffset:(\d+)\t(\S+)\t(-?\d+)", line) for line in out.stdout.splitlines()]
    assert all(rows) and len(rows) == total, out.stdout[-3000:]
    seen = {(int(m[1]), int(m[2])) for m in rows}
    assert len(seen) == total  # every record once
    keys = {(m[3], int(m[4])) for m in rows}
    assert keys <= {("NO_HEADERS", 7), ("NO_HEADERS", 8), ("kvstream-tick:", -1)}, keys
    assert ("kvstream-tick:", -1) in keys and ("NO_HEADERS", 7) in keys


def committed(settings: Settings, group: str) -> dict[int, int]:
    topic = settings.topics.name("events")
    c = Consumer(consumer_config(settings, group_id=group))
    try:
        tps = c.committed([TopicPartition(topic, p) for p in high_watermarks(settings)], timeout=10)
        return {tp.partition: tp.offset for tp in tps if tp.offset >= 0}
    finally:
        c.close()


def describe(settings: Settings, group: str) -> dict[int, tuple[int, int, int]]:
    """partition → (CURRENT-OFFSET, LOG-END-OFFSET, LAG), as kafka-consumer-groups
    --describe prints them."""
    out = run_tool("consumer-groups", "--bootstrap-server", settings.bootstrap, "--describe", "--group", group)
    assert out.returncode == 0, out.stderr[-3000:]
    topic = settings.topics.name("events")
    rows = {}
    for line in out.stdout.splitlines():
        cols = line.split()
        if len(cols) >= 6 and cols[0] == group and cols[1] == topic:
            rows[int(cols[2])] = (int(cols[3]), int(cols[4]), int(cols[5]))
    assert rows, out.stdout
    return rows


@pytest.mark.timeout(300)
def test_consumer_groups_shows_each_replicas_lag(kafka_topics: Settings) -> None:
    """Each replica commits its read positions to its own group: Kafka's
    kafka-consumer-groups --describe shows one caught up and one stopped behind."""
    records, _ = log_records(5)
    half = len(records) // 2
    produce(kafka_topics, records[:half])
    ids = [f"lag-{name}-{uuid.uuid4().hex[:6]}" for name in "ab"]
    a, b = (start(kafka_topics, replica_id=i, commit_interval_s=0.1) for i in ids)
    try:
        wait_caught_up(b, kafka_topics)
        b.stop()  # commits its last positions and stays behind from here
        b_positions = b.positions()
        produce(kafka_topics, records[half:])
        wait_caught_up(a, kafka_topics)
        a_positions = a.positions()
        until(lambda: committed(kafka_topics, replica_group_id(ids[0])) == a_positions, "replica a's commit")
        high = high_watermarks(kafka_topics)
        assert a_positions == high  # caught up: everything read
        assert committed(kafka_topics, replica_group_id(ids[1])) == b_positions
        shown_a = describe(kafka_topics, replica_group_id(ids[0]))
        shown_b = describe(kafka_topics, replica_group_id(ids[1]))
    finally:
        a.stop()
    assert shown_a == {p: (high[p], high[p], 0) for p in high}
    assert shown_b == {p: (b_positions[p], high[p], high[p] - b_positions[p]) for p in high}
    assert sum(lag for _, _, lag in shown_b.values()) == len(records) - half
