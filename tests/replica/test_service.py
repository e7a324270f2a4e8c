"""The replica's HTTP API (kvstream.replica.service) over a real replica and broker."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import orjson
import pytest
import uvicorn
from fastapi.testclient import TestClient

from kvstream.replica.peer import fetch_peer_snapshot
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.replica.service import MAX_TOKENS, create_app
from kvstream.replica.snapshot import SnapshotStore
from kvstream.settings import Settings

from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import produce, start, state, wait_caught_up

pytestmark = pytest.mark.kafka
TOKENS = list(range(16 * 6))


@pytest.fixture
def served(kafka_topics: Settings, tmp_path):
    a, b = FakeWorkerLog(1), FakeWorkerLog(2)
    produce(kafka_topics, [
        (1, a.batch(a.cleared(), a.stored(TOKENS))),
        (2, b.batch(b.cleared(), b.stored(TOKENS[:32]))),
    ])
    replica = start(kafka_topics, snapshot_dir=tmp_path / "snap")
    wait_caught_up(replica, kafka_topics)
    try:
        yield replica, TestClient(create_app(replica, token="s3cret"), headers={"Authorization": "Bearer s3cret"})
    finally:
        replica.stop()


def test_route_explain_and_request_lifecycle(served) -> None:
    replica, client = served
    r = client.post("/v1/route", json={"token_ids": TOKENS, "request_id": "r1", "explain": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["worker_id"], body["overlap"]["device"]) == (1, 6)
    assert {c["worker_id"] for c in body["candidates"]} == {1, 2}
    assert all({"logit", "prefill_cost", "credit", "new_blocks"} <= c.keys() for c in body["candidates"])
    assert client.post("/v1/route", json={"token_ids": TOKENS, "request_id": "r1"}).status_code == 409
    assert client.post("/v1/requests/r1/prefill_done").status_code == 200
    assert client.delete("/v1/requests/r1").status_code == 200
    assert client.delete("/v1/requests/r1").status_code == 404
    assert client.post("/v1/requests/nope/prefill_done").status_code == 404
    # Per-request weights change the decision's terms.
    r = client.post("/v1/route", json={"token_ids": TOKENS, "query_only": True, "weights": {"overlap_score_credit": 0}, "explain": True})
    assert all(c["credit"] == 0 for c in r.json()["candidates"])
    r = client.post("/v1/route", json={"token_ids": TOKENS, "query_only": True, "weights": {"allowed_workers": [2]}})
    assert r.json()["worker_id"] == 2


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({}, "missing required field `token_ids`"),
        ({"token_ids": "abc"}, "$.token_ids"),
        ({"token_ids": [1, -2]}, "$.token_ids[1]"),
        ({"token_ids": [2**32]}, "<= 4294967295"),
        ({"token_ids": [1.5]}, "Expected `int`"),
        ({"token_ids": [1], "weights": {"host_cache_hit_weight": -1}}, "$.weights.host_cache_hit_weight"),
        ({"token_ids": [1], "weights": {"bogus": 1}}, "unknown field `bogus`"),
        ({"token_ids": [1], "weights": {"allowed_workers": [2**64]}}, "`allowed_workers` must be below 2**64"),
        ({"token_ids": [1], "mm": [{"hash": 2**64, "offset": 0, "length": 1}]}, "`hash` must be below 2**64"),
        ({"token_ids": [1], "mm": [{"hash": 1, "offset": 0, "length": 0}]}, "$.mm[0].length"),
        ({"token_ids": [1], "surprise": True}, "unknown field `surprise`"),
        ({"token_ids": [1], "request_id": ""}, "$.request_id"),
        ({"token_ids": [1], "query_only": "yes"}, "$.query_only"),
        ({"token_ids": [1], "lora_name": "x" * 257}, "$.lora_name"),
        ({"token_ids": [0] * (MAX_TOKENS + 1)}, "length <= 1048576"),
    ],
)
def test_bad_requests_get_4xx_json(served, body, reason) -> None:
    replica, client = served
    r = client.post("/v1/route", json=body)
    assert r.status_code == 422 and r.json()["error"] == "invalid request", r.text
    assert any(reason in f"{d['msg']} - at {d['loc']}" for d in r.json()["details"]), r.text
    assert replica.router.active_requests() == 0
    assert client.get("/healthz").status_code == 200


def test_not_json_and_no_eligible_worker(served) -> None:
    _, client = served
    for raw, reason in ((b"{not json", "malformed"), (b"", "truncated"), (b"[1, 2]", "Expected `object`")):
        r = client.post("/v1/route", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 422 and reason in r.text, r.text
    r = client.post("/v1/route", json={"token_ids": TOKENS, "query_only": True, "weights": {"allowed_workers": [99]}})
    assert r.status_code == 503 and "error" in r.json()


def test_a_route_says_how_it_counts(served) -> None:
    """A route is a placement (request_id: load counted until DELETE) or a question
    (query_only): one that is neither would weigh nowhere, and is refused."""
    _, client = served
    for refused in (client.post("/v1/route", json={"token_ids": TOKENS}),
                    client.post("/v1/route", content=array("I", TOKENS).tobytes(),
                                headers={"content-type": "application/octet-stream"})):
        assert refused.status_code == 422, refused.text
        assert refused.json()["details"][0]["loc"] == "$.request_id"
        assert "query_only" in refused.json()["details"][0]["msg"]
    assert client.post("/v1/route", json={"token_ids": TOKENS, "query_only": True}).status_code == 200
    assert client.post("/v1/route", json={"token_ids": TOKENS, "request_id": "counted-1"}).json()["request_id"] == "counted-1"
    assert client.delete("/v1/requests/counted-1").status_code == 200


def test_auth_health_ready_metrics_workers(served) -> None:
    replica, client = served
    anon = TestClient(create_app(replica, token="s3cret"))
    assert anon.post("/v1/route", json={"token_ids": TOKENS}).status_code == 401
    assert anon.get("/healthz").status_code == 200
    assert anon.get("/readyz").json()["ready"] is True
    w = client.get("/v1/workers").json()["workers"]
    assert w["1"]["ranks"]["0"]["device"] == 6 and w["2"]["ranks"]["0"]["device"] == 2
    assert w["1"]["epoch"] == 1
    client.post("/v1/route", json={"token_ids": TOKENS, "query_only": True})
    text = client.get("/metrics").text
    for name in ("kvstream_events_applied_total", "kvstream_route_latency_seconds_bucket", "kvstream_partition_lag", "kvstream_snapshot_age_seconds", "kvstream_dlq_records_total"):
        assert name in text


def test_openapi_describes_the_route_bodies(served) -> None:
    replica, _ = served
    doc = TestClient(create_app(replica, docs=True)).get("/openapi.json").json()
    route = doc["paths"]["/v1/route"]["post"]
    assert set(route["requestBody"]["content"]) == {"application/json", "application/octet-stream"}
    assert "token_ids" in doc["components"]["schemas"]["RouteRequest"]["required"]
    assert {p["name"] for p in route["parameters"]} >= {"request_id", "query_only", "policy"}
    assert "/v1/workers" in doc["paths"]


def test_route_refused_until_ready(served) -> None:
    replica, client = served
    replica._ready.clear()
    try:
        assert client.post("/v1/route", json={"token_ids": TOKENS, "query_only": True}).status_code == 503
        assert client.get("/readyz").status_code == 503
    finally:
        replica._ready.set()


@contextmanager
def serve(app) -> Iterator[int]:
    """``app`` served by uvicorn on a free loopback port (yielded), in a thread."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        assert t.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        t.join(10)


def test_small_route_waits_for_a_busy_replica_off_the_loop(served) -> None:
    """A small request is decided on the event loop only while the replica's lock is
    free: while the fold holds it (here the test), the request waits in a routing
    thread, and the loop keeps answering."""
    replica, _ = served
    body = orjson.dumps({"token_ids": TOKENS, "query_only": True})
    head = (f"POST /v1/route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with serve(create_app(replica, token="s3cret")) as port, httpx.Client(timeout=10) as probe:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            with replica.lock:
                s.sendall(head + body)
                for _ in range(20):
                    assert probe.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
                s.setblocking(False)
                try:
                    assert s.recv(1, socket.MSG_PEEK) == b"", "answered while the replica was busy"
                except BlockingIOError:
                    pass  # no answer yet: it waits for the lock
            s.setblocking(True)
            answer = http.client.HTTPResponse(s)
            answer.begin()
            assert answer.status == 200 and orjson.loads(answer.read())["worker_id"] == 1


def test_peer_bootstrap_over_http(served, kafka_topics: Settings, tmp_path) -> None:
    replica, _ = served
    with replica.lock:
        replica.snapshotter.snapshot_now()
        expected = state(replica.fold)[0]
    with serve(create_app(replica, token="s3cret")) as port:
        fresh = start(kafka_topics, snapshot_dir=tmp_path / "fresh", peer_url=f"http://127.0.0.1:{port}", peer_token="s3cret")
        try:
            assert any("bootstrapped from peer" in n for n in fresh.recovery_notes)
            wait_caught_up(fresh, kafka_topics)
            with fresh.lock:
                assert state(fresh.fold)[0] == expected
        finally:
            fresh.stop()
        # A broken peer stream is refused whole.
        store = SnapshotStore(tmp_path / "other")
        with pytest.raises(Exception):
            fetch_peer_snapshot(f"http://127.0.0.1:{port}", store)  # no token: 401
        assert store.head() is None


def test_policy_switch_and_per_request_override(served, kafka_topics: Settings, tmp_path) -> None:
    """w1 decodes a long request, w2 prefills two shorter ones: a short prompt goes to w2
    under kv (§5 weighs w1's decode blocks) and to w1 under ttft (nothing queued there,
    while w2's second prompt waits whole behind the first, however long the test takes).
    The replica's [router] policy sets the default; the body's `policy` overrides it."""
    from kvstream.replica.cli import router_config
    from kvstream.settings import load_settings

    def load(client: TestClient, tag: str) -> None:
        long1 = {"token_ids": list(range(10_000, 14_000)), "request_id": f"long1-{tag}", "weights": {"allowed_workers": [1]}}
        r = client.post("/v1/route", json=long1)
        assert r.status_code == 200 and r.json()["worker_id"] == 1, r.text
        time.sleep(1.0)  # the rate w1 learns: ~4,000 tokens/s
        assert client.post(f"/v1/requests/long1-{tag}/prefill_done").status_code == 200
        for name, tokens in ((f"short2-{tag}", range(40_000, 40_032)), (f"long2-{tag}", range(20_000, 21_200))):
            r = client.post("/v1/route", json={"token_ids": list(tokens), "request_id": name, "weights": {"allowed_workers": [2]}})
            assert r.status_code == 200 and r.json()["worker_id"] == 2, r.text

    def choice(client: TestClient, policy: str | None) -> tuple[int, str]:
        body: dict = {"token_ids": list(range(30_000, 30_032)), "query_only": True}
        if policy is not None:
            body["policy"] = policy
        r = client.post("/v1/route", json=body)
        assert r.status_code == 200, r.text
        return r.json()["worker_id"], r.json()["policy"]

    _, client = served
    load(client, 'a')
    assert choice(client, None) == (2, "kv")
    assert choice(client, "ttft") == (1, "ttft")
    assert client.post("/v1/route", json={"token_ids": [1], "policy": "fastest"}).status_code == 422

    toml = tmp_path / "ttft.toml"
    toml.write_text('[router]\npolicy = "ttft"\n')
    settings = load_settings(toml, bootstrap=kafka_topics.bootstrap).model_copy(update={"topics": kafka_topics.topics})
    assert router_config(settings).scheduler.policy == "ttft"
    other = Replica(settings, ReplicaOptions(tick_interval_s=3600.0), router_config(settings))
    other.start()
    try:
        assert other.wait_ready(60)
        wait_caught_up(other, kafka_topics)
        c2 = TestClient(create_app(other))
        load(c2, 'b')
        assert choice(c2, None) == (1, "ttft")
        assert choice(c2, "kv") == (2, "kv")
    finally:
        other.stop()
