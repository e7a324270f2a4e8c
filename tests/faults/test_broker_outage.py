"""Issue 26 (1): a replica tells the truth when Kafka is gone. Its broker is stopped under
it: within seconds readiness, /v1/workers, each routing decision and a metric say that
the index is frozen and since when (routing goes on, marked stale); the broker comes
back and the marks go; and a replica stopped while the broker is down stops promptly."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvstream.kafka.local_broker import LocalCluster, start_local_cluster, stop_local_cluster
from kvstream.kafka.topics import ensure_topics
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.replica.service import create_app
from kvstream.settings import Settings, TopicSettings

from tests.kafka.nodes import kill_broker, restart_broker
from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import produce, wait_caught_up

pytestmark = [pytest.mark.faults, pytest.mark.kafka]

TOKENS = list(range(16 * 4))


@pytest.fixture(scope="module")
def own_broker() -> Iterator[LocalCluster]:
    """A broker of this module's own: the test stops it."""
    path = tempfile.mkdtemp(prefix="kvstream-outage-")
    try:
        yield start_local_cluster(1, path, owner_pid=os.getpid())
    finally:
        stop_local_cluster(path)
        shutil.rmtree(path, ignore_errors=True)


def _wait(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"not within {timeout}s: {what}"
        time.sleep(0.2)
    return time.monotonic() - start


@pytest.mark.timeout(600)
def test_broker_outage_is_reported_and_routing_goes_on(own_broker: LocalCluster) -> None:
    s = Settings(bootstrap=own_broker.bootstrap,
                 topics=TopicSettings(prefix=f"outage.{uuid.uuid4().hex[:8]}.", events_partitions=2))
    ensure_topics(s)
    w = FakeWorkerLog(20)
    produce(s, [(20, w.batch(w.cleared(), w.stored(TOKENS)))])
    r = Replica(s, ReplicaOptions(tick_interval_s=3600.0))
    r.start()
    try:
        assert r.wait_ready(60)
        wait_caught_up(r, s)
        with TestClient(create_app(r)) as client:
            route = lambda: client.post("/v1/route", json={"token_ids": TOKENS, "query_only": True})  # noqa: E731
            assert "stale" not in route().json()
            kill_broker(own_broker.dir, 1, signal.SIGKILL)
            killed = time.time()
            took = _wait(lambda: r.staleness() is not None, 30, "the replica noticed the broker is gone")
            stale = r.staleness()
            assert "broker_unreachable_since" in stale
            ready = client.get("/readyz")
            assert ready.status_code == 200, "routing goes on: still ready"
            body = ready.json()
            assert body["stale"]["broker_unreachable_since"] == stale["broker_unreachable_since"]
            assert any("stale" in reason for reason in body["reasons"])
            assert client.get("/v1/workers").json()["stale"] == stale
            decision = route()
            assert decision.status_code == 200 and decision.json()["worker_id"] == 20
            assert "broker_unreachable_since" in decision.json()["stale"]
            metrics = client.get("/metrics").text
            assert "kvstream_broker_unreachable 1.0" in metrics and "kvstream_index_stale 1.0" in metrics
            assert r.metrics.stale_decisions._value.get() >= 1
            restart_broker(own_broker.dir, 1)
            _wait(lambda: r.staleness() is None, 60, "the stale mark went when the broker came back")
            assert "stale" not in route().json()
            assert "kvstream_broker_unreachable 0.0" in client.get("/metrics").text
        print(f"FAULTS outage noticed_after_s={took:.1f} since={stale['broker_unreachable_since']} killed_at={killed:.0f}")
    finally:
        r.stop()


@pytest.mark.timeout(300)
def test_stop_does_not_wait_on_a_dead_broker(own_broker: LocalCluster) -> None:
    s = Settings(bootstrap=own_broker.bootstrap,
                 topics=TopicSettings(prefix=f"outage.{uuid.uuid4().hex[:8]}.", events_partitions=2))
    ensure_topics(s)
    w = FakeWorkerLog(21)
    produce(s, [(21, w.batch(w.cleared(), w.stored(TOKENS)))])
    r = Replica(s, ReplicaOptions(tick_interval_s=3600.0))
    r.start()
    assert r.wait_ready(60)
    wait_caught_up(r, s)
    kill_broker(own_broker.dir, 1, signal.SIGKILL)
    try:
        _wait(lambda: r.staleness() is not None, 30, "the replica noticed the broker is gone")
        t0 = time.monotonic()
        r.stop()
        stopped = time.monotonic() - t0
    finally:
        restart_broker(own_broker.dir, 1)
    assert stopped < 8, f"stopping took {stopped:.1f}s with the broker down"
