"""Kafka for a benchmark run: the broker given by ``--bootstrap``, else a local broker
started in a temporary directory for the run (and stopped after it); topics under a
prefix unique to the run, created first and deleted after."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import click
from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient
from tqdm import tqdm

from kvstream.events.wire import worker_key
from kvstream.kafka.config import admin_config, consumer_config, producer_config
from kvstream.kafka.errors import BrokerError
from kvstream.kafka.local_broker import start_local_cluster, stop_local_cluster
from kvstream.kafka.metadata import end_offsets, topic_partitions
from kvstream.kafka.topics import ensure_topics
from kvstream.replica.replica import Replica
from kvstream.settings import Settings, TopicSettings

bootstrap_option = click.option(
    "--bootstrap",
    envvar="KVSTREAM_BOOTSTRAP",
    help="Kafka to use; default: start a local broker for the run and stop it after.",
)


@contextmanager
def broker(bootstrap: str | None) -> Iterator[str]:
    """``bootstrap`` itself, or the bootstrap of a local broker that lives for the block."""
    if bootstrap:
        yield bootstrap
        return
    cluster_dir = tempfile.mkdtemp(prefix="kvstream-bench-kafka-")
    click.echo("starting a local Kafka broker...", err=True)
    try:
        # owner_pid: the broker stops itself should this process die without cleaning up.
        cluster = start_local_cluster(1, cluster_dir, owner_pid=os.getpid())
    except BrokerError as exc:
        shutil.rmtree(cluster_dir, ignore_errors=True)
        raise click.ClickException(f"cannot start the local broker (or pass --bootstrap): {exc}") from None
    try:
        yield cluster.bootstrap
    finally:
        stop_local_cluster(cluster_dir)
        shutil.rmtree(cluster_dir, ignore_errors=True)


@contextmanager
def bench_topics(bootstrap: str, **topic_fields: Any) -> Iterator[Settings]:
    """Settings whose topics carry a fresh ``bench.<id>.`` prefix (``TopicSettings``
    fields as keyword arguments); the topics exist inside the block only."""
    prefix = f"bench.{uuid.uuid4().hex[:12]}."
    settings = Settings(bootstrap=bootstrap, topics=TopicSettings(prefix=prefix, **topic_fields))
    try:
        ensure_topics(settings)
        _wait_served(settings)
        yield settings
    finally:
        admin = AdminClient(admin_config(settings))
        names = [n for n in admin.list_topics(timeout=30).topics if n.startswith(prefix)]
        if names:
            for future in admin.delete_topics(names, request_timeout=30).values():
                future.result(timeout=30)


@contextmanager
def kafka_env(bootstrap: str | None, **topic_fields: Any) -> Iterator[Settings]:
    """:func:`broker` and :func:`bench_topics` together."""
    with broker(bootstrap) as servers, bench_topics(servers, **topic_fields) as settings:
        yield settings


def _wait_served(settings: Settings, timeout: float = 60.0) -> None:
    """Return once every events partition answers offset queries: a topic just created
    may still lack partition leaders for a moment."""
    try:
        high_watermarks(settings, timeout=timeout)
    except KafkaException as exc:
        raise click.ClickException(f"the new topics are not served after {timeout:.0f}s: {exc}") from None


def high_watermarks(settings: Settings, role: str = "events", timeout: float = 30.0) -> dict[int, int]:
    """Next offset to be written, per partition of the topic of ``role`` (retried while
    its leaders are elected, up to ``timeout`` s)."""
    topic = settings.topics.name(role)
    consumer = Consumer(consumer_config(settings))
    try:
        return end_offsets(consumer, topic, topic_partitions(consumer, topic, timeout), timeout)
    finally:
        consumer.close()


def produce_records(settings: Settings, records: Sequence[tuple[int, bytes]], desc: str = "producing") -> None:
    """Write ``(worker id, value)`` records to the events topic, keyed by worker as the
    publisher keys them, and wait until Kafka acknowledged every one."""
    topic = settings.topics.name("events")
    failures: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(str(err))

    producer = Producer(producer_config(settings, **{"client.id": "kvstream-bench-log"}))
    for wid, value in tqdm(records, desc=desc, unit="rec", file=sys.stderr, mininterval=1.0):
        while True:
            try:
                producer.produce(topic, value=value, key=worker_key(wid), on_delivery=delivered)
                break
            except BufferError:  # the client's queue is full: let deliveries make room
                producer.poll(0.05)
        producer.poll(0)
    left = producer.flush(300)
    if left or failures:
        raise click.ClickException(
            f"{left} records unacknowledged, {len(failures)} failed: {failures[:1]}"
        )


def wait_applied(replica: Replica, targets: Mapping[int, int], timeout: float, desc: str = "applying") -> float:
    """Wait until ``replica``'s fold has read every partition up to ``targets`` (next
    offsets); returns the wall-clock time (``time.time()``) at which it had."""
    total = sum(targets.values())
    deadline = time.monotonic() + timeout
    with tqdm(total=total, desc=desc, unit="rec", file=sys.stderr, mininterval=1.0) as bar:
        while True:
            with replica.lock:
                offsets = replica.fold.next_offsets()
            now = time.time()
            done = sum(min(offsets.get(p, 0), hw) for p, hw in targets.items())
            bar.update(done - bar.n)
            if done >= total:
                return now
            if time.monotonic() > deadline:
                raise click.ClickException(f"the replica read {done} of {total} records in {timeout:.0f}s")
            time.sleep(0.005)


def wait_settled(replica: Replica, settings: Settings, timeout: float, desc: str = "applying") -> None:
    """Wait until ``replica`` has read the events topic to its end and the end no longer
    moves (a replica writes a log-clock tick where a worker's lease ran out), then until it reports
    ready."""
    deadline = time.monotonic() + timeout
    targets = high_watermarks(settings)
    while True:
        wait_applied(replica, targets, max(1.0, deadline - time.monotonic()), desc)
        time.sleep(0.5)  # ticks just produced take a few ms to land
        now = high_watermarks(settings)
        if now == targets:
            break
        targets = now
    if not replica.wait_ready(max(1.0, deadline - time.monotonic())):
        raise click.ClickException(f"the replica did not report ready within {timeout:.0f}s (lag {replica.lag()})")
