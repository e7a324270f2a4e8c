"""Each routable worker's mode on a real broker (issue 33): ``events`` while its KV events
arrive within its lease, ``approximate`` for one that publishes none or whose events
stopped (routed by the blocks routed to it, and what it last held on the device,
within its capacity), and back to ``events`` when they return; /v1/workers and
``kvstream_worker_mode`` say so."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
from prometheus_client import generate_latest

from kvstream.gateway.options import GatewayOptions, StaticWorker
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.router.index import WorkerKey
from kvstream.settings import Settings

from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import produce

pytestmark = pytest.mark.kafka

PROMPT = list(range(700, 700 + 16 * 8))


def wait(cond: Callable[[], bool], why: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, why
        time.sleep(0.05)


def mode_metric(replica: Replica, worker: int, mode: str) -> float:
    want = f'kvstream_worker_mode{{mode="{mode}",worker="{worker}"}}'
    for line in generate_latest(replica.metrics.registry).decode().splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    return -1.0


def test_modes_follow_the_events(kafka_topics: Settings) -> None:
    # Worker 1 bridges its events; worker 9 is an engine with no bridge (static, capacity 40).
    static = (StaticWorker(1, "http://127.0.0.1:1", ("m",)), StaticWorker(9, "http://127.0.0.1:2", ("m",), kv_capacity_blocks=40))
    settings = kafka_topics.model_copy(update={"gateway": GatewayOptions(workers=static)})
    w1 = FakeWorkerLog(1, lease_ms=1500)
    produce(settings, [(1, w1.batch(w1.cleared(), w1.stored(PROMPT[:64])))], register=False)
    replica = Replica(settings, ReplicaOptions(tick_interval_s=0.2, modes_interval_s=0.05))
    replica.start()
    try:
        assert replica.wait_ready(60)
        view = lambda: replica.workers_view()["workers"]  # noqa: E731
        wait(lambda: view().get("1", {}).get("mode") == "events" and view().get("9", {}).get("mode") == "approximate",
             "modes never showed")
        assert mode_metric(replica, 9, "approximate") == 1 and mode_metric(replica, 9, "events") == 0
        # Worker 9 is routed by what was routed to it, never more than its capacity.
        rng = random.Random(0)
        for i in range(20):
            prompt = [rng.randrange(1, 50_000) for _ in range(16 * 8)]
            replica.route(prompt, request_id=f"r{i}", candidates=[WorkerKey(9, 0)])
        assert view()["9"]["expected_blocks"] == {"0": 40}
        again = replica.route(prompt, query_only=True, candidates=[WorkerKey(9, 0)])
        assert again.chosen.overlap.expected == 8
        # Worker 1's events stop: its lease runs out (the ticks move the log time), it is
        # routed approximately, by what it held on the device.
        wait(lambda: view()["1"].get("mode") == "approximate", "worker 1's lease never ran out")
        assert mode_metric(replica, 1, "approximate") == 1
        assert view()["1"]["expected_blocks"] == {"0": 4}
        d = replica.route(PROMPT, query_only=True, candidates=[WorkerKey(1, 0), WorkerKey(9, 0)])
        assert d.overlaps[WorkerKey(1, 0)].expected == 4
        # Its events return (a new incarnation): they win, the predictions are dropped.
        back = FakeWorkerLog(1, epoch=2, lease_ms=60_000)
        produce(settings, [(1, back.batch(back.cleared(), back.stored(PROMPT[:32])))], register=False)
        wait(lambda: view()["1"].get("mode") == "events", "worker 1 never came back")
        assert "expected_blocks" not in view()["1"] and view()["1"]["ranks"]["0"]["device"] == 2
        assert mode_metric(replica, 1, "events") == 1
    finally:
        replica.stop()
