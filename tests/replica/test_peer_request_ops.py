"""A ``prefill_done`` or ``DELETE`` that reaches another replica than the one that routed
the request (what a load-balanced Service does) takes effect there and on every replica,
through kvstream.active, as if the owner had received it."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from kvstream.replica.replica import Replica
from kvstream.replica.service import create_app
from kvstream.router.index import WorkerKey
from kvstream.settings import Settings
from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import produce, start, wait_caught_up

pytestmark = pytest.mark.kafka
TOKENS = list(range(16 * 4))


def _requests(replica: Replica) -> int:
    with replica.lock:
        load = replica.router.load(WorkerKey(1, 0))
    return 0 if load is None else load.requests


def _until(check, why: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, why
        time.sleep(0.05)


def test_prefill_done_and_free_reach_the_owner_from_any_replica(kafka_topics: Settings) -> None:
    w = FakeWorkerLog(1)
    produce(kafka_topics, [(1, w.batch(w.cleared(), w.stored(TOKENS)))])
    replicas = [start(kafka_topics) for _ in range(3)]
    try:
        for r in replicas:
            wait_caught_up(r, kafka_topics)
        a, b, c = (TestClient(create_app(r)) for r in replicas)
        assert a.post("/v1/route", json={"token_ids": TOKENS, "request_id": "r1"}).status_code == 200
        _until(lambda: all(_requests(r) == 1 for r in replicas), "the route's load did not reach every replica")
        # b never routed r1: it marks and frees it for the owner, and everyone follows.
        _until(lambda: b.post("/v1/requests/r1/prefill_done").status_code == 200, "b never took r1's prefill_done")
        def decoding(r: Replica) -> bool:
            with r.lock:
                return r.router.load(WorkerKey(1, 0)).prefill_tokens == 0

        _until(lambda: all(decoding(r) for r in replicas), "the owner and the others never saw r1 decoding")
        assert b.delete("/v1/requests/r1").status_code == 200
        _until(lambda: all(_requests(r) == 0 for r in replicas), "a free sent to a peer left the load somewhere")
        assert a.delete("/v1/requests/r1").status_code == 404  # gone everywhere
        assert c.delete("/v1/requests/r1").status_code == 404
        # The same client id active on two replicas: a third cannot tell which is meant.
        for client in (a, b):
            assert client.post("/v1/route", json={"token_ids": TOKENS, "request_id": "dup"}).status_code == 200
        _until(lambda: _requests(replicas[2]) == 2, "c never saw both requests")
        r = c.delete("/v1/requests/dup")
        assert r.status_code == 409 and "several other replicas" in r.json()["error"]
        assert b.delete("/v1/requests/dup").status_code == 200  # its own
        _until(lambda: c.delete("/v1/requests/dup").status_code == 200, "c could not free the one left")
        _until(lambda: all(_requests(r) == 0 for r in replicas), "load left behind")
        for r in replicas:
            assert r.metrics.active_errors._metrics == {}  # every op applied where it went
    finally:
        for r in replicas:
            r.stop()


def test_a_refuted_delete_takes_the_prediction_back_on_every_replica(kafka_topics: Settings) -> None:
    """A route makes its prompt's blocks past the worker's cache expected there, on every
    replica (through its ADD op); ``DELETE ...?refuted=true`` (the request failed before
    its first token), sent to any replica, takes them back everywhere."""
    w = FakeWorkerLog(1)
    produce(kafka_topics, [(1, w.batch(w.cleared(), w.stored(TOKENS)))])
    replicas = [start(kafka_topics) for _ in range(2)]

    def expected(r: Replica) -> dict:
        return r.workers_view()["workers"]["1"].get("expected_blocks", {})

    try:
        for r in replicas:
            wait_caught_up(r, kafka_topics)
        a, b = (TestClient(create_app(r)) for r in replicas)
        longer = TOKENS + list(range(900, 900 + 32))  # 2 blocks past what worker 1 holds
        assert a.post("/v1/route", json={"token_ids": longer, "request_id": "r2"}).json()["worker_id"] == 1
        _until(lambda: all(expected(r) == {"0": 2} for r in replicas), "the prediction did not reach every replica")
        route = b.post("/v1/route", json={"token_ids": longer, "query_only": True, "explain": True}).json()
        assert route["overlap"] == {"device": 4, "host_pinned": 0, "disk": 0, "external": 0, "expected": 2}
        assert b.delete("/v1/requests/r2?refuted=true").status_code == 200
        _until(lambda: all(expected(r) == {} for r in replicas), "a refuted free left a prediction somewhere")
    finally:
        for r in replicas:
            r.stop()
