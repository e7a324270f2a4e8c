"""Issue 13: the Kafka ACLs of docs/RELIABILITY.md ("The log's authority"), proven on a
real broker: a KRaft node with a SASL/PLAIN listener and Kafka's StandardAuthorizer,
ACLs added with Kafka's own ``kafka-acls`` tool (org.apache.kafka.tools.AclCommand).
A worker principal with Write on ``kvstream.events`` publishes; a principal with Read
only (an operator, ``kvstream replay``) reads, but cannot write a single record."""

from __future__ import annotations

import base64
import functools
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic

from kvstream.tools.procs import free_port

from tests.faults.helpers import ROOT

pytestmark = [pytest.mark.faults, pytest.mark.kafka, pytest.mark.slow]

BROKER_SH = ROOT / "ops" / "kafka" / "broker.sh"
USERS = {"admin": "admin-secret", "worker-7": "worker-secret", "operator": "operator-secret"}
TOPIC = "kvstream.events"


def _client(port: int, user: str, **extra: object) -> dict[str, object]:
    return {"bootstrap.servers": f"127.0.0.1:{port}", "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "PLAIN", "sasl.username": user, "sasl.password": USERS[user], **extra}


def _start_node(dir: Path) -> tuple[subprocess.Popen, int]:
    port, controller = free_port(), free_port()
    jaas = ("org.apache.kafka.common.security.plain.PlainLoginModule required "
            'username="admin" password="admin-secret" '
            + " ".join(f'user_{u}="{p}"' for u, p in USERS.items()) + ";")
    props = dir / "server.properties"
    props.write_text("\n".join([
        "process.roles=broker,controller", "node.id=1", f"controller.quorum.voters=1@127.0.0.1:{controller}",
        f"listeners=SASL_PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}",
        f"advertised.listeners=SASL_PLAINTEXT://127.0.0.1:{port}",
        "listener.security.protocol.map=SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT",
        "controller.listener.names=CONTROLLER", "inter.broker.listener.name=SASL_PLAINTEXT",
        "sasl.enabled.mechanisms=PLAIN", "sasl.mechanism.inter.broker.protocol=PLAIN",
        f"listener.name.sasl_plaintext.plain.sasl.jaas.config={jaas}",
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        # The controller listener is plaintext on loopback: its principal is ANONYMOUS.
        "super.users=User:admin;User:ANONYMOUS", "allow.everyone.if.no.acl.found=false",
        f"log.dirs={dir / 'data'}", "auto.create.topics.enable=false",
        "offsets.topic.replication.factor=1", "transaction.state.log.replication.factor=1",
        "transaction.state.log.min.isr=1", "group.initial.rebalance.delay.ms=0",
        "num.network.threads=2", "num.io.threads=2", "log.cleaner.dedupe.buffer.size=8388608",
    ]) + "\n")
    java = ["java", "-Xmx384m", "-XX:+UseSerialGC", "-cp", kafka_classpath()]
    cluster_id = "-"
    while cluster_id.startswith("-"):  # a leading '-' reads as a flag (ops/kafka/broker.sh's rule)
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    subprocess.run(java + ["kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props)],
                   check=True, capture_output=True, timeout=120)
    log = open(dir / "node.out", "wb")
    logging = [f"-Dlog4j2.configurationFile={ROOT / 'ops' / 'kafka' / 'log4j2.properties'}",
               f"-Dkafka.logs.dir={dir}", "-Dkvstream.node=acl-node"]
    proc = subprocess.Popen(java[:1] + logging + java[1:] + ["kafka.Kafka", str(props)], stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    admin = AdminClient(_client(port, "admin"))
    while True:
        assert proc.poll() is None, (dir / "node.out").read_text()[-3000:]
        try:
            if admin.list_topics(timeout=2).brokers:
                return proc, port
        except KafkaException:
            pass
        assert time.monotonic() < deadline, "the SASL broker did not start"
        time.sleep(0.3)


def _acls(port: int, dir: Path, *args: str) -> None:
    """kafka-acls.sh, as an operator runs it."""
    cfg = dir / "admin.properties"
    cfg.write_text("security.protocol=SASL_PLAINTEXT\nsasl.mechanism=PLAIN\n"
                   'sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required '
                   'username="admin" password="admin-secret";\n')
    subprocess.run(["java", "-Xmx256m", "-cp", kafka_classpath(), "org.apache.kafka.tools.AclCommand",
                    "--bootstrap-server", f"127.0.0.1:{port}", "--command-config", str(cfg), "--add", *args],
                   check=True, capture_output=True, timeout=120)


def _produce(port: int, user: str, idempotent: bool) -> KafkaError | None:
    """Publish one record as ``user``; the delivery error, if any. (Without idempotence
    a refusal can only come from the topic's Write ACL, not from IdempotentWrite.)"""
    errors: list[KafkaError | None] = []
    p = Producer(_client(port, user, **{"enable.idempotence": idempotent, "acks": "all", "message.timeout.ms": 15000}))
    p.produce(TOPIC, b"a batch", key=(7).to_bytes(8, "big"), on_delivery=lambda err, _m: errors.append(err))
    p.flush(30)
    return errors[0] if errors else KafkaError(KafkaError._TIMED_OUT)


@functools.cache
def kafka_classpath() -> str:
    """The broker's and Kafka's tools' jars, fetched by the test set-up (ops/env.sh runs
    ``broker.sh fetch-tools``) or now: this test never depends on what ran before it."""
    assert shutil.which("java"), "java not found: the ACL test runs Kafka's own broker and kafka-acls"
    dirs = []
    for cmd in ("fetch", "fetch-tools"):
        run = subprocess.run(["bash", str(BROKER_SH), cmd], capture_output=True, text=True, timeout=1800)
        assert run.returncode == 0, f"broker.sh {cmd} failed: {run.stderr[-2000:]}"
        dirs.append(run.stdout.strip().splitlines()[-1])
    return ":".join(f"{d}/*" for d in dirs)


@pytest.mark.timeout(1800)
def test_only_principals_with_write_on_events_can_publish(tmp_path: Path) -> None:
    proc, port = _start_node(tmp_path)
    try:
        admin = AdminClient(_client(port, "admin"))
        admin.create_topics([NewTopic(TOPIC, 1, 1)])[TOPIC].result(60)
        _acls(port, tmp_path, "--allow-principal", "User:worker-7", "--operation", "Write",
              "--operation", "Describe", "--topic", TOPIC)
        _acls(port, tmp_path, "--allow-principal", "User:worker-7", "--operation", "IdempotentWrite", "--cluster")
        _acls(port, tmp_path, "--allow-principal", "User:operator", "--operation", "Read",
              "--operation", "Describe", "--topic", "kvstream.", "--resource-pattern-type", "prefixed")
        _acls(port, tmp_path, "--allow-principal", "User:operator", "--operation", "Read", "--group", "*")
        assert _produce(port, "worker-7", idempotent=True) is None
        refused = _produce(port, "operator", idempotent=False)
        assert refused is not None and refused.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, refused
        # The operator reads what the worker wrote, and only that.
        c = Consumer(_client(port, "operator", **{"group.id": "replay-1", "enable.auto.commit": False}))
        try:
            c.assign([TopicPartition(TOPIC, 0, 0)])
            got = []
            deadline = time.monotonic() + 30
            while not got and time.monotonic() < deadline:
                got = [m for m in c.consume(10, 0.5) if m.error() is None]
            assert [m.value() for m in got] == [b"a batch"]
        finally:
            c.close()
        print(f"FAULTS acl worker=ok operator_write={refused.name()}")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
