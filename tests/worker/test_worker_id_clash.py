"""A worker-id clash is never silent (issue 26): a worker started beside a live process
with its id is refused with one line naming the other (epoch, engine URL, when it
registered) unless told ``--take-over``; a restart after a clean stop is not refused; and
the two incarnations of a take-over, both publishing, are what a replica's fold reports
as a clash. Two real synthetic worker processes against a real broker."""

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

from kvstream.events.codec import EventCodec
from kvstream.kafka.config import consumer_config
from kvstream.replica.fold import WORKER_CLASH, LogFold
from kvstream.router import Router
from kvstream.worker.incarnation import kafka_partition

from .test_worker_cli import KVSTREAM, free_port, scrape


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
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def records(settings) -> list[tuple[int, int, int, bytes]]:
    """(partition, offset, timestamp ms, value) of every events record, in offset order."""
    topic = settings.topics.name("events")
    consumer = Consumer(consumer_config(settings, **{"enable.partition.eof": True}))
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        out, at_end, deadline = [], set(), time.monotonic() + 30
        while len(at_end) < len(parts) and time.monotonic() < deadline:
            for msg in consumer.consume(100, timeout=0.5):
                if msg.error() is None:
                    out.append((msg.partition(), msg.offset(), msg.timestamp()[1], msg.value()))
                elif msg.error().code() == KafkaError._PARTITION_EOF:
                    at_end.add(msg.partition())
        return out
    finally:
        consumer.close()


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
    clash: dict = {}
    metric = ""
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
        # Both publish; the replica asks the stale one to resync above the other, in turn:
        # a clash, on /v1/workers and in the metrics.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (clash and clash.get("batches", 0) >= 2):
            try:
                clash = json.loads(get(rport, "/v1/workers"))["workers"].get("5", {}).get("clash") or {}
            except OSError:
                pass
            time.sleep(0.3)
        metric = get(rport, "/metrics")
    finally:
        out1 = stop(first)
        out3 = stop(third) if third is not None else ""
        out_replica = stop(replica)
    assert "worker_taking_over" in out3, out3
    assert clash.get("batches", 0) >= 2, (clash, out_replica)
    # Each epoch the processes started (at start, and at each resync the replica asked).
    epochs = {int(e) for e in re.findall(r"epoch=(\d+)", out1 + out3)}
    assert {clash["held_epoch"], clash["stale_epoch"]} <= epochs
    assert re.search(r'^kvstream_events_rejected\{reason="worker_id_clash"\} [1-9]', metric, re.MULTILINE), metric
    assert out_replica.count("worker id clash: two processes publish as one worker") == 1, out_replica
    epoch1 = int(re.search(r"worker_started .*?epoch=(\d+)", out1)[1])
    assert f"epoch {epoch1}," in line

    # What a fold of that log (as replay folds it) says: the same clash.
    codec = EventCodec()
    fold = LogFold(Router(), codec.decode)
    for partition, offset, ts, value in sorted(records(kafka_topics), key=lambda r: (r[0], r[1])):
        fold.apply_record(partition, offset, ts, value)
    assert fold.counters[WORKER_CLASH] > 0
    assert {fold.clashes[5].held_epoch, fold.clashes[5].stale_epoch} <= epochs


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
