"""Issue 13 (8): request ids are scoped per replica and restricted to a safe set. Two
replicas that accept the same client ids track two sets of requests: one client's
DELETE on one replica never frees the other's (main: 13 of 13 freed); an id that could
not be named in a URL again is refused at routing."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from kvstream.replica.replica import Replica
from kvstream.replica.service import create_app
from kvstream.settings import Settings

from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import produce, start, wait_caught_up

pytestmark = [pytest.mark.faults, pytest.mark.kafka]

TOKENS = list(range(16 * 4))
IDS = [f"req-{i}" for i in range(13)]


def peer_ops_seen(r: Replica) -> float:
    """Peer ops applied or refused by ``r`` so far."""
    m = r.metrics
    applied = m.active_ops.labels(source="peer")._value.get()
    refused = sum(s.value for metric in m.active_errors.collect() for s in metric.samples if s.name.endswith("_total"))
    return applied + refused


def wait_peer_ops(r: Replica, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while peer_ops_seen(r) < n:
        assert time.monotonic() < deadline, f"{r.replica_id} saw {peer_ops_seen(r)} peer ops, not {n}"
        time.sleep(0.05)


def test_two_replicas_same_ids_never_free_each_other(kafka_topics: Settings) -> None:
    w = FakeWorkerLog(1, lease_ms=10**9)
    produce(kafka_topics, [(1, w.batch(w.cleared(), w.stored(TOKENS)))])
    a, b = start(kafka_topics), start(kafka_topics)
    try:
        wait_caught_up(a, kafka_topics)
        wait_caught_up(b, kafka_topics)
        ca, cb = TestClient(create_app(a)), TestClient(create_app(b))
        for rid in IDS:
            for c in (ca, cb):
                r = c.post("/v1/route", json={"token_ids": TOKENS, "request_id": rid})
                assert r.status_code == 200 and r.json()["request_id"] == rid, r.text
        wait_peer_ops(a, len(IDS))
        wait_peer_ops(b, len(IDS))
        with a.lock, b.lock:
            held = (a.router.active_requests(), b.router.active_requests())  # each should carry both loads
        for rid in IDS:
            assert ca.delete(f"/v1/requests/{rid}").status_code == 200
        wait_peer_ops(b, 2 * len(IDS))
        freed_by_other = sum(cb.delete(f"/v1/requests/{rid}").status_code == 404 for rid in IDS)
        print(f"FAULTS request_ids same_ids={len(IDS)} active_held={held} freed_by_the_other_replica={freed_by_other}")
        assert held == (2 * len(IDS), 2 * len(IDS)) and freed_by_other == 0
        wait_peer_ops(a, 2 * len(IDS))
        with a.lock, b.lock:
            assert a.router.active_requests() == b.router.active_requests() == 0
        # Unsafe ids are refused where they come in, so every accepted id can be freed.
        for bad in ("a/b", "a b", "x" * 129, "é", "../x", ""):
            r = ca.post("/v1/route", json={"token_ids": TOKENS, "request_id": bad})
            assert r.status_code == 422, (bad, r.text)
        assert ca.delete("/v1/requests/a%20b").status_code == 422
        ok = "Req_1.2:3-x"
        assert ca.post("/v1/route", json={"token_ids": TOKENS, "request_id": ok}).status_code == 200
        assert ca.delete(f"/v1/requests/{ok}").status_code == 200
    finally:
        a.stop()
        b.stop()
