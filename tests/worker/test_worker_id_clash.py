"""A worker-id clash is never silent (issue 26): a worker started beside a live process
with its id is refused with one line naming the other (epoch, engine URL, when it
registered) unless told ``--take-over``; a restart after a clean stop is not refused; and
the process taken over sees its successor's registration and stops by itself, without
the withdrawals of a clean stop (its tombstone and "cleared" would erase the successor
from every replica). Two real synthetic worker processes against a real broker."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request

import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition

from kvstream.events.wire import worker_key
from kvstream.kafka.config import consumer_config
from kvstream.tools.procs import free_port
from kvstream.worker.incarnation import kafka_partition

from .test_worker_cli import KVSTREAM, scrape


def start(settings, seed: int, *extra: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(
        [
            KVSTREAM, "worker", "--engine", "synthetic", "--worker-id", "5", "--rate", "10", "--seed", str(seed),
            "--bootstrap", settings.bootstrap, "--metrics-port", str(port), "--device-blocks", "64", *extra,
        ],
        env={**os.environ, "KVSTREAM_TOPICS__PREFIX": settings.topics.prefix},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    return proc, port


def wait_publishing(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if scrape(port).get("kvstream_worker_blocks_acked_total", 0) > 0:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"worker never published: {proc.communicate()[0] if proc.poll() is not None else ''}")


def stop(proc: subprocess.Popen) -> str:
    if proc.stdout.closed:  # already read to its end
        return ""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_replica(settings) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(
        [KVSTREAM, "router", "--bootstrap", settings.bootstrap, "--port", str(port), "--no-gateway"],
        env={**os.environ, "KVSTREAM_TOPICS__PREFIX": settings.topics.prefix},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    return proc, port


def get(port: int, path: str) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).read().decode()


@pytest.mark.slow
def test_a_second_worker_with_a_live_id_is_refused_unless_it_takes_over(kafka_topics):
    pytest.importorskip("torch")
    replica, rport = start_replica(kafka_topics)
    first, port = start(kafka_topics, 1)
    second = third = None
    worker: dict = {}
    m = None
    try:
        wait_publishing(first, port)
        second, _ = start(kafka_topics, 2)
        out = second.communicate(timeout=120)[0]
        assert second.returncode == 1, out
        (line,) = [ln for ln in out.splitlines() if ln.startswith("Error:")]
        assert re.fullmatch(
            r"Error: another process publishes as worker 5: epoch \d+, no engine URL, registered at "
            r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z, last heard \d+\.\ds ago; stop it, give this one another "
            r"--worker-id, or pass --take-over to replace it",
            line,
        ), line
        assert "Traceback" not in out

        third, port3 = start(kafka_topics, 2, "--take-over")
        wait_publishing(third, port3)
        # The first sees the third's registration and stops by itself.
        out1 = first.communicate(timeout=60)[0]
        assert first.returncode == 1, out1
        (taken,) = [ln for ln in out1.splitlines() if ln.startswith("Error:")]
        m = re.fullmatch(
            r"Error: worker 5 was taken over by another process \(epoch (\d+), no engine URL, registered at "
            r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\); this one stopped without withdrawing its blocks or its "
            r"registration",
            taken,
        )
        assert m, taken
        assert "Traceback" not in out1
        # What the replica shows once the first is gone: the third's registration and its
        # blocks (a clean stop of the first would have tombstoned the one and cleared the other).
        epoch1 = int(re.search(r"worker_started .*?epoch=(\d+)", out1)[1])
        assert f"epoch {epoch1}," in line
        time.sleep(3)
        worker = json.loads(get(rport, "/v1/workers"))["workers"]["5"]
    finally:
        stop(first)
        out3 = stop(third) if third is not None else ""
        out_replica = stop(replica)
    assert "worker_taking_over" in out3, out3
    epoch3 = int(re.search(r"worker_started .*?epoch=(\d+)", out3)[1])
    assert int(m[1]) == epoch3 != epoch1
    assert worker["registration"]["epoch"] == epoch3, worker
    assert sum(n for tiers in worker["ranks"].values() for n in tiers.values()) > 0, worker
    assert third.returncode == 0, out3
    # The third's own clean stop withdraws: the registry's last record for the id is its tombstone.
    assert registry_values(kafka_topics, worker_key(5))[-1] is None
    assert "Traceback" not in out_replica


def registry_values(settings, key: bytes) -> list[bytes | None]:
    """The values of one key on kvstream.workers, in offset order."""
    topic = settings.topics.name("workers")
    consumer = Consumer(consumer_config(settings, **{"enable.partition.eof": True}))
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        out, at_end, deadline = [], set(), time.monotonic() + 30
        while len(at_end) < len(parts) and time.monotonic() < deadline:
            for msg in consumer.consume(100, timeout=0.5):
                if msg.error() is None and msg.key() == key:
                    out.append(msg.value())
                elif msg.error() is not None and msg.error().code() == KafkaError._PARTITION_EOF:
                    at_end.add(msg.partition())
        return out
    finally:
        consumer.close()


@pytest.mark.slow
def test_a_restart_after_a_clean_stop_is_not_refused(kafka_topics):
    pytest.importorskip("torch")
    first, port = start(kafka_topics, 1)
    try:
        wait_publishing(first, port)
    finally:
        out = stop(first)
    assert first.returncode == 0, out
    t0 = time.monotonic()
    again, port = start(kafka_topics, 2)
    try:
        wait_publishing(again, port)
    finally:
        out = stop(again)
    assert "worker_id_recently_used" not in out, out
    assert time.monotonic() - t0 < 60


def test_the_partition_of_a_key_is_kafkas():
    # Kafka's own vectors (its Java client's UtilsTest: murmur2 of "21" and "foobar").
    assert kafka_partition(b"21", 1 << 31) == -973932308 & 0x7FFFFFFF
    assert kafka_partition(b"foobar", 1 << 31) == -790332482 & 0x7FFFFFFF
