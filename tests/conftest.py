"""Shared fixtures. ``kafka_bootstrap`` is a real KRaft Kafka (DESIGN.md §10); where it
comes from is ``KVSTREAM_TEST_KAFKA``:

- ``external``: the cluster ``KVSTREAM_BOOTSTRAP`` names;
- ``docker``: kvstream's Kafka image (docker/kafka, ``KVSTREAM_TEST_KAFKA_IMAGE`` to use
  another) through testcontainers, on the engine ``DOCKER_HOST`` names;
- ``local``: the local broker of ops/kafka/broker.sh;
- ``auto`` (default): external when ``KVSTREAM_BOOTSTRAP`` is set, else docker when an
  engine answers and the image is present or pullable, else local.

The session prints one line saying which it took and why."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from kvstream.kafka.config import admin_config
from kvstream.kafka.local_broker import SCRIPT as BROKER_SCRIPT
from kvstream.kafka.local_broker import start_local_cluster, stop_local_cluster
from kvstream.kafka.topics import ensure_topics
from kvstream.settings import Settings, TopicSettings

KAFKA_SOURCES = ("auto", "external", "docker", "local")
#: Where kvstream's Kafka image takes the advertised listeners from (docker/kafka/kafka.sh).
ADVERTISED_FILE = "/tmp/advertised.listeners"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Whatever uses the broker is a kafka test, marked or not, so `-m "not kafka"` skips it;
    # session_broker picks exactly the tests that KVSTREAM_TEST_KAFKA concerns.
    for item in items:
        if "kafka_bootstrap" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kafka)
            item.add_marker(pytest.mark.session_broker)


@dataclass(frozen=True)
class KafkaChoice:
    source: str  # external | docker | local
    why: str
    image: str = ""


def kafka_image() -> str:
    """kvstream's Kafka image, tagged with the version of the local broker's jars."""
    if explicit := os.environ.get("KVSTREAM_TEST_KAFKA_IMAGE"):
        return explicit
    version = subprocess.run(
        ["bash", str(BROKER_SCRIPT), "version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
    return f"kvstream-kafka:{version}"


def docker_problem(image: str) -> str | None:
    """Why ``image`` cannot run on the Docker engine of ``DOCKER_HOST``; None if it can
    (the engine answers and the image is present, or pulled now)."""
    try:
        import docker
        from docker.errors import DockerException, ImageNotFound
    except ImportError:
        return "the docker package is not installed"
    where = os.environ.get("DOCKER_HOST") or "the default socket"
    try:
        client = docker.from_env(timeout=10)
    except DockerException:
        return f"no Docker engine answers at {where}"
    try:
        client.ping()
    except (DockerException, OSError):  # requests' connection errors are OSErrors
        return f"no Docker engine answers at {where}"
    try:
        try:
            client.images.get(image)
        except ImageNotFound:
            try:
                client.images.pull(image)
            except (DockerException, OSError) as exc:
                return f"a Docker engine answers at {where}, but {image} is neither present nor pullable ({exc})"
        return None
    finally:
        client.close()


def choose_kafka() -> KafkaChoice:
    wanted = os.environ.get("KVSTREAM_TEST_KAFKA", "auto")
    if wanted not in KAFKA_SOURCES:
        raise pytest.UsageError(f"KVSTREAM_TEST_KAFKA={wanted!r}: expected one of {', '.join(KAFKA_SOURCES)}")
    bootstrap = os.environ.get("KVSTREAM_BOOTSTRAP")
    if wanted == "external" or (wanted == "auto" and bootstrap):
        if not bootstrap:
            raise pytest.UsageError("KVSTREAM_TEST_KAFKA=external needs KVSTREAM_BOOTSTRAP")
        return KafkaChoice("external", f"KVSTREAM_BOOTSTRAP={bootstrap}")
    if wanted == "local":
        return KafkaChoice("local", "KVSTREAM_TEST_KAFKA=local")
    image = kafka_image()
    problem = docker_problem(image)
    if wanted == "docker":
        if problem:
            pytest.fail(f"KVSTREAM_TEST_KAFKA=docker, but {problem}", pytrace=False)
        return KafkaChoice("docker", f"KVSTREAM_TEST_KAFKA=docker, image {image}", image)
    if problem:
        return KafkaChoice("local", problem)
    return KafkaChoice("docker", f"a Docker engine answers and {image} is there", image)


def _docker_kafka(image: str) -> Iterator[str]:
    """A container of kvstream's Kafka image on a random host port. The node waits for its
    advertised listeners until the port mapping is known, as testcontainers' own Kafka
    module does for Confluent's image."""
    from docker.errors import ImageNotFound
    from testcontainers.core.config import testcontainers_config
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import LogMessageWaitStrategy

    container = DockerContainer(image).with_exposed_ports(9092).with_env("KVSTREAM_KAFKA_ADVERTISED_FILE", ADVERTISED_FILE)
    try:
        container.get_docker_client().client.images.get(testcontainers_config.ryuk_image)
    except ImageNotFound:
        # Without a registry there is no Ryuk (the reaper): the fixture removes its container.
        testcontainers_config.ryuk_disabled = True
    stopped = False

    def stop() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            gc.collect()  # see _local_kafka
            container.stop()

    atexit.register(stop)
    try:
        container.start()
        host = container.get_container_host_ip()
        host = "127.0.0.1" if host == "localhost" else host
        port = container.get_exposed_port(9092)
        listeners = f"PLAINTEXT://{host}:{port},BROKER://localhost:9094"
        tmp = f"{ADVERTISED_FILE}.tmp"
        result = container.exec(["sh", "-c", f"printf %s '{listeners}' > {tmp} && mv {tmp} {ADVERTISED_FILE}"])
        assert result.exit_code == 0, result.output
        LogMessageWaitStrategy("Kafka Server started").with_startup_timeout(180).wait_until_ready(container)
        yield f"{host}:{port}"
    finally:
        stop()
        atexit.unregister(stop)


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
def kafka_bootstrap(pytestconfig: pytest.Config) -> Iterator[str]:
    """``host:port[,...]`` of a real Kafka broker for this test session."""
    choice = choose_kafka()
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        # Past the output capture, so that the line shows whatever the test's outcome.
        with capture.global_and_fixture_disabled():
            reporter.ensure_newline()
            reporter.write_line(f"kafka_bootstrap: {choice.source} ({choice.why})")
    if choice.source == "external":
        yield os.environ["KVSTREAM_BOOTSTRAP"]
    elif choice.source == "docker":
        yield from _docker_kafka(choice.image)
    else:
        yield from _local_kafka()


@pytest.fixture(scope="session")
def kafka_image_name() -> str:
    """kvstream's Kafka image, as the docker source of ``kafka_bootstrap`` runs it."""
    return kafka_image()


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
