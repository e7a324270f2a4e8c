"""Replicas that route at once split ties between them (kvstream.replica.load): each
learns from kvstream.active which replicas are routing, and keeps its own part of the
workers, in worker id order, for a tie; one that stops routing leaves the split."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from kvstream.replica import load
from kvstream.replica.replica import Replica
from kvstream.replica.service import create_app
from kvstream.settings import Settings
from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import produce, start, wait_caught_up

pytestmark = pytest.mark.kafka


def _routing(replica: Replica) -> float:
    return replica.metrics.routing_replicas._value.get()


def test_replicas_routing_at_once_break_ties_in_their_own_parts(kafka_topics: Settings, monkeypatch) -> None:
    logs = [FakeWorkerLog(w) for w in (4, 1, 3, 2)]
    produce(kafka_topics, [(w.worker_id, w.batch(w.cleared(), w.stored(list(range(900, 916))))) for w in logs])
    replicas = sorted((start(kafka_topics) for _ in range(3)), key=lambda r: r.replica_id)
    try:
        for r in replicas:
            wait_caught_up(r, kafka_topics)
            assert _routing(r) == 1
        clients = [TestClient(create_app(r)) for r in replicas]
        # Each routes (and ends) one request: its load ops tell the others it is routing.
        for n, c in enumerate(clients):
            assert c.post("/v1/route", json={"token_ids": list(range(100 * n, 100 * n + 32)), "request_id": "hello"}).status_code == 200
            assert c.delete("/v1/requests/hello").status_code == 200
        deadline = time.monotonic() + 20
        while not all(_routing(r) == 3 for r in replicas):
            assert time.monotonic() < deadline, [_routing(r) for r in replicas]
            time.sleep(0.05)
        # A prompt cached nowhere, on idle workers: a tie, broken in each one's part of
        # workers 1..4 (the first replica's part is 1 and 2; then 3; then 4).
        parts = [{1, 2}, {3}, {4}]
        for c, part in zip(clients, parts):
            got = {c.post("/v1/route", json={"token_ids": list(range(5000 + 40 * i, 5040 + 40 * i)), "query_only": True})
                   .json()["worker_id"] for i in range(12)}
            assert got <= part, (got, part)
        # Quiet for longer than the window: each is on its own again.
        monkeypatch.setattr(load, "ROUTING_WINDOW_S", 0.5)
        deadline = time.monotonic() + 20
        while not all(_routing(r) == 1 for r in replicas):
            assert time.monotonic() < deadline, [_routing(r) for r in replicas]
            time.sleep(0.05)
    finally:
        for r in replicas:
            r.stop()
