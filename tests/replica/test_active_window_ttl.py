"""Issue 24: a (re)started replica rebuilds load from kvstream.active over the request TTL
(``[router] request_ttl_s``), as ``kvstream replay explain`` does, not over a fixed
300 s: at a 600 s TTL a request routed 400 s ago still loads its worker for both."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Producer

from kvstream.hashing import block_hashes
from kvstream.kafka.config import producer_config
from kvstream.replica.active_codec import ActiveOpCodec
from kvstream.replica.cli import router_config
from kvstream.replica.options import ReplicaOptions
from kvstream.replica.replica import Replica
from kvstream.replica.request_ids import scoped
from kvstream.replica.route_body import RouteRequest
from kvstream.router.active import AddRequest
from kvstream.router.explain import decision_dict
from kvstream.settings import Settings, SettingsError, load_settings
from kvstream.tools.replay.explain import explain_at

from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import produce, wait_caught_up

TTL_S = 600.0


def _add(request_id: str, worker_id: int, age_s: float, now_s: float) -> tuple[bytes, int]:
    """An add op of a 10-block request routed ``age_s`` ago by another replica, and the
    record time it was logged at (the live replica stamps the op's time on it)."""
    _, seq = block_hashes(list(range(160)))
    at = now_s - age_s
    op = AddRequest(scoped("router-gone", request_id), worker_id, 0, 160, 0, tuple(seq), at)
    return ActiveOpCodec().encode("router-gone", op), int(at * 1000)


def _by_worker(d: dict) -> dict:
    return {c["worker_id"]: c for c in d["candidates"]}


@pytest.mark.kafka
def test_a_restarted_replica_and_replay_see_the_same_load_at_a_600s_ttl(kafka_topics: Settings) -> None:
    settings = kafka_topics.model_copy(
        update={"router": kafka_topics.router.model_copy(update={"request_ttl_s": TTL_S})}
    )
    workers = [FakeWorkerLog(w, lease_ms=10**9) for w in (1, 2)]
    produce(settings, [(w.worker_id, w.batch(w.cleared())) for w in workers])
    now = time.time()
    p = Producer(producer_config(settings))
    # 400 s ago: past the old fixed window (300 s), within the TTL. 700 s ago: expired.
    for value, ts in (_add("inside-ttl", 1, 400, now), _add("past-ttl", 2, 700, now)):
        p.produce(settings.topics.name("active"), value=value, key=b"r", timestamp=ts)
    assert p.flush(30) == 0

    replica = Replica(settings, ReplicaOptions(tick_interval_s=3600.0), router_config(settings))
    replica.start()
    try:
        assert replica.wait_ready(60)
        wait_caught_up(replica, settings)
        prompt = list(range(5000, 5000 + 16 * 4))
        t_ms = int(time.time() * 1000)
        replayed = _by_worker(explain_at(settings, t_ms, RouteRequest(token_ids=prompt, query_only=True)).decision)
        # The op on the log before the replica started: its load thread reads it at once.
        deadline = time.monotonic() + 15
        while True:
            live = _by_worker(decision_dict(replica.route(prompt, query_only=True), explain=True))
            if live[1]["active_requests"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        replica.stop()
    assert replayed[1]["active_requests"] == 1 and replayed[1]["active_prefill_tokens"] == 160
    assert replayed[2]["active_requests"] == 0
    for wid in (1, 2):
        for term in ("active_requests", "active_prefill_tokens", "active_decode_blocks"):
            assert live[wid][term] == replayed[wid][term], (wid, term, live[wid], replayed[wid])


def test_a_ttl_longer_than_the_load_topic_keeps_is_refused(tmp_path) -> None:
    path = tmp_path / "k.toml"
    path.write_text("[router]\nrequest_ttl_s = 7200\n")
    with pytest.raises(SettingsError, match=r"request_ttl_s \(7200 s\) is longer than topics.active_retention_ms \(3600000 ms\)"):
        load_settings(path)
    path.write_text("[router]\nrequest_ttl_s = 7200\n[topics]\nactive_retention_ms = 7200000\n")
    assert load_settings(path).router.request_ttl_s == 7200
