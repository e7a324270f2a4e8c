"""The local development broker: it answers, forms a 3-node cluster, survives a node loss,
and never leaves a process behind."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from kvstream.cli import cli
from kvstream.kafka.config import producer_config, resolve_bootstrap
from kvstream.kafka.errors import BrokerError, KafkaConfigError
from kvstream.kafka.local_broker import cluster_status, start_local_cluster, stop_local_cluster
from kvstream.kafka.topics import ROLES, ensure_topics
from kvstream.settings import Settings, TopicSettings

from tests.kafka.nodes import kill_broker, restart_broker


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.kafka
def test_the_broker_answers(kafka_bootstrap: str) -> None:
    metadata = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=30)
    assert len(metadata.brokers) >= 1


def test_a_foreign_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(BrokerError, match="not empty"):
        start_local_cluster(1, tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


@pytest.mark.kafka
@pytest.mark.slow
def test_cli_start_stop_leaves_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The default cluster folder, made this test's own.
    monkeypatch.setenv("KVSTREAM_BROKER_DIR", str(tmp_path / "broker"))
    monkeypatch.delenv("KVSTREAM_BOOTSTRAP", raising=False)
    runner = CliRunner()
    pids: list[int] = []
    try:
        started = runner.invoke(cli, ["broker", "start"])
        assert started.exit_code == 0, started.output
        bootstrap = started.stdout.strip().splitlines()[-1]
        assert bootstrap.startswith("127.0.0.1:")
        assert (tmp_path / "broker" / "bootstrap").read_text().strip() == bootstrap

        # A second start finds it running and hands back the same bootstrap.
        again = runner.invoke(cli, ["broker", "start"])
        assert again.exit_code == 0 and again.stdout.strip().splitlines()[-1] == bootstrap

        status = runner.invoke(cli, ["broker", "status"])
        assert status.exit_code == 0 and "running" in status.stdout
        pids = [pid for pid in cluster_status().nodes.values() if pid is not None]
        assert len(pids) == 1 and _alive(pids[0])

        # Without a bootstrap setting, clients find the local broker.
        assert resolve_bootstrap(Settings(bootstrap=None)) == bootstrap
        created = runner.invoke(cli, ["topics", "create"])
        assert created.exit_code == 0, created.output
        assert created.stdout.count("created") == len(ROLES)
        described = runner.invoke(cli, ["topics", "describe"])
        assert described.exit_code == 0 and described.stdout.count("exists") == len(ROLES)
    finally:
        stopped = runner.invoke(cli, ["broker", "stop"])
    assert stopped.exit_code == 0, stopped.output
    assert not any(_alive(pid) for pid in pids)
    status = runner.invoke(cli, ["broker", "status"])
    assert status.exit_code == 1 and "stopped" in status.stdout
    assert resolve_bootstrap_or_none() is None


def resolve_bootstrap_or_none() -> str | None:
    try:
        return resolve_bootstrap(Settings(bootstrap=None))
    except KafkaConfigError:
        return None


@pytest.mark.kafka
@pytest.mark.slow
def test_three_nodes_survive_the_loss_of_one_and_stop_with_their_owner(tmp_path: Path) -> None:
    owner = subprocess.Popen(["sleep", "600"])
    cluster = start_local_cluster(3, tmp_path / "cluster", owner_pid=owner.pid)
    try:
        pids = cluster_status(cluster.dir).nodes
        assert len(pids) == 3 and all(pid is not None for pid in pids.values())
        admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
        assert len(admin.list_topics(timeout=30).brokers) == 3

        settings = Settings(
            bootstrap=cluster.bootstrap, topics=TopicSettings(prefix="fault.", events_partitions=3)
        )
        events = ensure_topics(settings)[0]
        assert events.replication_factor == 3
        assert events.config["min.insync.replicas"] == "2"

        kill_broker(cluster.dir, 2, signal.SIGKILL)
        assert cluster_status(cluster.dir).nodes[2] is None
        # acks=all still succeeds with two of three replicas in sync.
        producer = Producer(producer_config(settings, **{"message.timeout.ms": 60_000}))
        failures: list[object] = []
        for i in range(30):
            producer.produce(
                settings.topics.name("events"), b"v", str(i).encode(),
                on_delivery=lambda err, _m: failures.append(err) if err else None,
            )
        assert producer.flush(90) == 0
        assert failures == []
        del producer

        restart_broker(cluster.dir, 2)
        restarted = cluster_status(cluster.dir)
        assert restarted.running
        assert len(admin.list_topics(timeout=30).brokers) == 3
        del admin

        # The owner dies: the watchdog (checks every 2 s) stops every node by itself.
        owner.kill()
        owner.wait()
        live = [pid for pid in restarted.nodes.values() if pid is not None]
        deadline = time.monotonic() + 90
        while any(_alive(pid) for pid in live) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(_alive(pid) for pid in live)
    finally:
        owner.kill()
        stop_local_cluster(cluster.dir)
    assert cluster_status(cluster.dir).nodes == {1: None, 2: None, 3: None}
