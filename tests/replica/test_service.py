"""The replica's HTTP API (kvstream.replica.service) over a real replica and broker."""

from __future__ import annotations

import threading
import time

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
    "body",
    [
        {},
        {"token_ids": "abc"},
        {"token_ids": [1, -2]},
        {"token_ids": [2**32]},
        {"token_ids": [1.5]},
        {"token_ids": [1], "weights": {"host_cache_hit_weight": -1}},
        {"token_ids": [1], "weights": {"bogus": 1}},
        {"token_ids": [1], "surprise": True},
        {"token_ids": [1], "request_id": ""},
        {"token_ids": [0] * (MAX_TOKENS + 1)},
    ],
)
def test_bad_requests_get_4xx_json(served, body) -> None:
    replica, client = served
    r = client.post("/v1/route", json=body)
    assert 400 <= r.status_code < 500 and "error" in r.json()
    assert client.get("/healthz").status_code == 200


def test_not_json_and_no_eligible_worker(served) -> None:
    _, client = served
    r = client.post("/v1/route", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    r = client.post("/v1/route", json={"token_ids": TOKENS, "weights": {"allowed_workers": [99]}})
    assert r.status_code == 503 and "error" in r.json()


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


def test_route_refused_until_ready(served) -> None:
    replica, client = served
    replica._ready.clear()
    try:
        assert client.post("/v1/route", json={"token_ids": TOKENS}).status_code == 503
        assert client.get("/readyz").status_code == 503
    finally:
        replica._ready.set()


def test_peer_bootstrap_over_http(served, kafka_topics: Settings, tmp_path) -> None:
    replica, _ = served
    with replica.lock:
        replica.snapshotter.snapshot_now()
        expected = state(replica.fold)[0]
    server = uvicorn.Server(uvicorn.Config(create_app(replica, token="s3cret"), host="127.0.0.1", port=0, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
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
    finally:
        server.should_exit = True
        t.join(10)


def test_policy_switch_and_per_request_override(served, kafka_topics: Settings, tmp_path) -> None:
    """w1 decodes a long request, w2 prefills a shorter one: a short prompt goes to w2
    under kv (§5 weighs w1's decode blocks) and to w1 under ttft (nothing queued there).
    The replica's [router] policy sets the default; the body's `policy` overrides it."""
    from kvstream.replica.cli import router_config
    from kvstream.settings import load_settings

    def load(client: TestClient, tag: str) -> None:
        long1 = {"token_ids": list(range(10_000, 14_000)), "request_id": f"long1-{tag}", "weights": {"allowed_workers": [1]}}
        r = client.post("/v1/route", json=long1)
        assert r.status_code == 200 and r.json()["worker_id"] == 1, r.text
        time.sleep(0.01)  # a measurable TTFT: the rate w1 learns
        assert client.post(f"/v1/requests/long1-{tag}/prefill_done").status_code == 200
        long2 = {"token_ids": list(range(20_000, 20_600)), "request_id": f"long2-{tag}", "weights": {"allowed_workers": [2]}}
        r = client.post("/v1/route", json=long2)
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
