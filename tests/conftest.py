"""Shared fixtures. ``kafka_bootstrap`` is a real KRaft Kafka (DESIGN.md §10), from, in order:
``KVSTREAM_BOOTSTRAP`` (an external cluster), testcontainers' Kafka module when a Docker
engine answers, or the local broker of ops/kafka/broker.sh."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from kvstream.kafka.config import admin_config
from kvstream.kafka.local_broker import start_local_cluster, stop_local_cluster
from kvstream.kafka.topics import ensure_topics
from kvstream.settings import Settings, TopicSettings


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Whatever uses the broker is a kafka test, marked or not, so `-m "not kafka"` skips it.
    for item in items:
        if "kafka_bootstrap" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kafka)


def _docker_answers() -> bool:
    """A cheap check for a Docker engine (there is none on the development machines)."""
    try:
        import docker
        from docker.errors import DockerException
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=3)
    except DockerException:
        return False
    try:
        return bool(client.ping())
    except (DockerException, OSError):  # requests' connection errors are OSErrors
        return False
    finally:
        client.close()


def _testcontainers_kafka() -> Iterator[str]:
    from testcontainers.community.kafka import KafkaContainer

    container = KafkaContainer().with_kraft()
    container.start()
    try:
        yield container.get_bootstrap_server()
    finally:
        container.stop()


def _local_kafka() -> Iterator[str]:
    cluster_dir = tempfile.mkdtemp(prefix="kvstream-kafka-")
    done = False

    def cleanup() -> None:
        nonlocal done
        if not done:
            done = True
            # Kafka clients that tests left for the garbage collector go first, so that
            # they do not spend the end of the session dialling a stopped broker.
            gc.collect()
            stop_local_cluster(cluster_dir)
            shutil.rmtree(cluster_dir, ignore_errors=True)

    # finally covers failures inside the session, atexit an interpreter that exits around
    # pytest, and owner_pid (a watchdog in broker.sh) a session killed outright.
    atexit.register(cleanup)
    try:
        cluster = start_local_cluster(1, cluster_dir, owner_pid=os.getpid())
        yield cluster.bootstrap
    finally:
        cleanup()
        atexit.unregister(cleanup)


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``host:port[,...]`` of a real Kafka broker for this test session."""
    external = os.environ.get("KVSTREAM_BOOTSTRAP")
    if external:
        yield external
    elif _docker_answers():
        yield from _testcontainers_kafka()
    else:
        yield from _local_kafka()


@pytest.fixture
def kafka_topics_factory(kafka_bootstrap: str) -> Iterator[Callable[..., Settings]]:
    """Makes Settings whose topics carry a prefix unique to the test (``TopicSettings``
    fields as keyword arguments), creates the topics unless ``create=False``, and deletes
    them after the test."""
    made: list[Settings] = []

    def make(*, create: bool = True, **topic_fields: Any) -> Settings:
        topic_fields.setdefault("prefix", f"test.{uuid.uuid4().hex[:12]}.")
        settings = Settings(bootstrap=kafka_bootstrap, topics=TopicSettings(**topic_fields))
        made.append(settings)
        if create:
            ensure_topics(settings)
        return settings

    yield make
    for settings in made:
        admin = AdminClient(admin_config(settings))
        names = [n for n in admin.list_topics(timeout=30).topics if n.startswith(settings.topics.prefix)]
        if names:
            for future in admin.delete_topics(names, request_timeout=30).values():
                future.result(timeout=30)


@pytest.fixture
def kafka_topics(kafka_topics_factory: Callable[..., Settings]) -> Settings:
    """Settings with this test's own topics (4 event partitions), already created."""
    return kafka_topics_factory(events_partitions=4)
