"""The worker registry through a real broker: a ``kvstream worker`` process registers
and its tombstone removes it on every replica; replicas started at any time agree; poison
records on the topic are counted and skipped, never stop a replica."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import Producer
from fastapi.testclient import TestClient

from kvstream.events.codec import AvroCodec
from kvstream.events.registration import Registration, RegistrationCodec
from kvstream.events.wire import worker_key
from kvstream.gateway.static import RegisteredDirectory
from kvstream.kafka.config import producer_config
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.replica.service import create_app
from kvstream.roles import Handoff, Role
from kvstream.settings import Settings

KVSTREAM = Path(sys.executable).parent / "kvstream"
ROOT = Path(__file__).resolve().parents[2]


def start_replica(settings: Settings) -> Replica:
    r = Replica(settings, ReplicaOptions(tick_interval_s=3600.0))
    r.start()
    assert r.wait_ready(60), f"replica never became ready: {r.not_ready_reasons()}"
    return r


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _env(settings: Settings) -> dict[str, str]:
    env = dict(os.environ, KVSTREAM_TOPICS__PREFIX=settings.topics.prefix, KVSTREAM_LOG_LEVEL="WARNING")
    env.pop("KVSTREAM_CONFIG", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def replay_workers(settings: Settings) -> dict:
    out = subprocess.run(
        [str(KVSTREAM), "replay", "workers", "--json", "--bootstrap", settings.bootstrap],
        env=_env(settings), capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def registration(r: Replica, wid: int) -> dict | None:
    return r.workers_view()["workers"].get(str(wid), {}).get("registration")


def test_worker_registers_and_its_tombstone_removes_it_everywhere(kafka_topics: Settings, tmp_path: Path) -> None:
    a, b = start_replica(kafka_topics), start_replica(kafka_topics)
    log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen(
        [str(KVSTREAM), "worker", "--engine", "zmq", "--endpoint", "tcp://127.0.0.1:1", "--endpoint",
         "tcp://127.0.0.1:2", "--dp-rank", "4", "--block-size", "32", "--worker-id", str(2**64 - 3),
         "--engine-url", "http://127.0.0.1:8123/", "--model", "llama", "--model", "llama-alias", "--lora", "sql",
         "--role", "prefill", "--handoff", "bootstrap", "--bootstrap-port", "8998", "--bootstrap", kafka_topics.bootstrap],
        env=_env(kafka_topics), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
    )
    wid = 2**64 - 3
    try:
        for r in (a, b):
            wait_for("the registration on every replica", lambda r=r: registration(r, wid) is not None)
            ep = RegisteredDirectory(r.registry).endpoint(wid)
            assert ep is not None
            assert (ep.url, ep.models, ep.loras, ep.block_size, ep.dp_ranks, ep.engine) == (
                "http://127.0.0.1:8123", ("llama", "llama-alias"), ("sql",), 32, 2, "zmq")
            assert (ep.role, ep.handoff, ep.bootstrap_port) == (Role.PREFILL, Handoff.BOOTSTRAP, 8998)
            reg = registration(r, wid)
            assert reg["dp_ranks"] == [4, 5] and reg["routable"] and reg["epoch"] > 0
        assert registration(a, wid) == registration(b, wid)
        assert replay_workers(kafka_topics)["workers"][str(wid)] == registration(a, wid)
        # What an operator sees on /v1/workers.
        client = TestClient(create_app(b, token="t"), headers={"Authorization": "Bearer t"})
        shown = client.get("/v1/workers").json()["workers"][str(wid)]
        reg = shown["registration"]
        assert (reg["url"], reg["models"], reg["loras"]) == ("http://127.0.0.1:8123", ["llama", "llama-alias"], ["sql"])
        assert (shown["role"], reg["role"], reg["handoff"], reg["bootstrap_port"]) == ("prefill", "prefill", "bootstrap", 8998)
        assert f'kvstream_worker_role{{role="prefill",worker="{wid}"}} 1.0' in client.get("/metrics").text
        # A replica that starts now reads the registry from the topic's start.
        c = start_replica(kafka_topics)
        try:
            assert registration(c, wid) == registration(a, wid)
        finally:
            c.stop()
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0, (tmp_path / "worker.log").read_text()
        log.close()
    try:
        for r in (a, b):
            wait_for("the tombstone on every replica", lambda r=r: registration(r, wid) is None)
            assert RegisteredDirectory(r.registry).endpoints() == ()
        doc = replay_workers(kafka_topics)
        assert doc["workers"] == {} and doc["applied"] == 2
        late = start_replica(kafka_topics)
        try:
            assert late.registry.registrations() == {}
        finally:
            late.stop()
    finally:
        a.stop()
        b.stop()


def test_poison_registrations_are_counted_and_skipped(kafka_topics: Settings) -> None:
    a = start_replica(kafka_topics)
    codec = RegistrationCodec()
    good = Registration(11, "http://127.0.0.1:9000", ("m",), (), 16, (0,), "vllm", 512, 1, 0)
    other = AvroCodec().encode("kvstream.control.ResyncRequest", {
        "worker_id": 1, "requester": "x", "reason": "y", "requested_at_ms": 0})
    records = [
        (b"short", codec.encode(good)),  # not a worker id
        (worker_key(12), codec.encode(good)),  # another worker's key
        (worker_key(11), b"\xc3\x01garbage"),  # undecodable
        (worker_key(11), other),  # another record type
        (worker_key(13), None),  # a tombstone of no registered worker
        (worker_key(11), codec.encode(good)),
    ]
    producer = Producer(producer_config(kafka_topics))
    for key, value in records:
        producer.produce(kafka_topics.topics.name("workers"), key=key, value=value)
    assert producer.flush(30) == 0
    b = start_replica(kafka_topics)  # reads the poison from the topic's start
    try:
        for r in (a, b):
            wait_for("the good registration", lambda r=r: r.registry.registration(11) is not None)
            assert set(r.registry.registrations()) == {11}
            assert r.registry.skipped == {"bad_key": 1, "wrong_key": 1, "undecodable": 2, "unknown_tombstone": 1}
            skipped = {
                s.labels["reason"]: s.value for m in r.metrics.registry.collect()
                if m.name == "kvstream_registry_skipped" for s in m.samples if s.name.endswith("_total")
            }
            assert skipped == {"bad_key": 1.0, "wrong_key": 1.0, "undecodable": 2.0, "unknown_tombstone": 1.0}
            assert r.ready, r.not_ready_reasons()
        assert a.registry.registrations() == b.registry.registrations()
        doc = replay_workers(kafka_topics)
        assert doc["skipped"] == {"bad_key": 1, "wrong_key": 1, "undecodable": 2, "unknown_tombstone": 1}
        assert doc["workers"]["11"]["kv_capacity_blocks"] == 512
    finally:
        a.stop()
        b.stop()


def test_a_starting_replica_is_ready_only_with_the_whole_registry(kafka_topics: Settings) -> None:
    # More registrations than one consume takes: readiness waits for the topic's end as it
    # was at start, not for the first batch.
    codec = RegistrationCodec()
    producer = Producer(producer_config(kafka_topics))
    for wid in range(1, 1201):
        reg = Registration(wid, f"http://127.0.0.1:{9000 + wid}", ("m",), (), 16, (0,), "vllm", 512, 1, 0)
        producer.produce(kafka_topics.topics.name("workers"), key=worker_key(wid), value=codec.encode(reg))
    assert producer.flush(30) == 0
    r = Replica(kafka_topics, ReplicaOptions(tick_interval_s=3600.0))
    r.start()
    try:
        assert r.wait_ready(60), f"replica never became ready: {r.not_ready_reasons()}"
        assert len(r.registry.registrations()) == 1200
    finally:
        r.stop()
