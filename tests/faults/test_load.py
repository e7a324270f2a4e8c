"""Issue 9 (6): sustained load on a ``kvstream router`` process over loopback: a steady
stream of worker events plus routing requests (route → prefill_done → free) for a fixed
time, with the process's resident memory measured after warm-up and at the end; then a
burst of events, after which the lag returns to zero."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import httpx
import pytest
from confluent_kafka import Producer

from kvstream.kafka.config import producer_config
from kvstream.settings import Settings
from kvstream.tools.procs import free_port
from kvstream.worker.announce import register_synthetic

from tests.faults.helpers import rss_mib, spawn_router, stop_process, wait_http
from tests.replica.helpers import FakeWorkerLog

pytestmark = [pytest.mark.faults, pytest.mark.kafka, pytest.mark.slow]

WARMUP_S = 8.0
STEADY_S = 30.0
EVENTS_PER_S = 400
BURST = 20_000
#: Allowed growth of resident memory over the steady phase. The index is bounded (each
#: worker stores and evicts over a fixed set of prompts; requests are freed), so what
#: remains is allocator and client-library noise.
RSS_GROWTH_MIB = 32.0
LAG_RECOVERY_S = 120.0


class WorkerStream:
    """Workers that keep storing and evicting prompts from a fixed pool: a steady
    stream of valid events whose index size stays bounded."""

    def __init__(self, workers: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.prompts = [[self.rng.randrange(50_000) for _ in range(16 * 8)] for _ in range(40)]
        self.logs = [FakeWorkerLog(100 + w) for w in range(workers)]
        self.held: list[list[list[int]]] = [[] for _ in range(workers)]
        self.started = [False] * workers

    def next(self) -> tuple[int, bytes]:
        w = self.rng.randrange(len(self.logs))
        log, held = self.logs[w], self.held[w]
        if not self.started[w]:
            self.started[w] = True
            toks = self.rng.choice(self.prompts)
            held.append(toks)
            return log.worker_id, log.batch(log.cleared(), log.stored(toks))
        if len(held) > 4 or (held and self.rng.random() < 0.5):
            return log.worker_id, log.batch(log.removed(held.pop(0)))
        toks = self.rng.choice([p for p in self.prompts if p not in held])
        held.append(toks)
        return log.worker_id, log.batch(log.stored(toks))


def _publish(settings: Settings, stream: WorkerStream, stop: threading.Event, rate: float, sent: list[int]) -> None:
    p = Producer(producer_config(settings))
    topic = settings.topics.name("events")
    t0 = time.monotonic()
    while not stop.is_set():
        wid, value = stream.next()
        p.produce(topic, value, key=wid.to_bytes(8, "big"))
        sent[0] += 1
        p.poll(0)
        ahead = sent[0] / rate - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    assert p.flush(60) == 0


def _route_loop(base: str, prompts: list[list[int]], stop: threading.Event, counts: dict[str, int]) -> None:
    rng = random.Random(3)
    with httpx.Client(base_url=base, timeout=10) as client:
        i = 0
        while not stop.is_set():
            i += 1
            toks = rng.choice(prompts) + [rng.randrange(50_000) for _ in range(40)]
            r = client.post("/v1/route", json={"token_ids": toks, "request_id": f"r{i}"})
            answers = [("route", r)]
            if r.status_code == 200:
                answers += [("prefill_done", client.post(f"/v1/requests/r{i}/prefill_done")),
                            ("free", client.delete(f"/v1/requests/r{i}"))]
            for op, resp in answers:
                key = f"{op} {resp.status_code}"
                counts[key] = counts.get(key, 0) + 1


def _total_lag(base: str) -> int:
    return sum(httpx.get(f"{base}/readyz", timeout=5).json()["lag"].values())


@pytest.mark.timeout(300)
def test_sustained_load_memory_and_burst_lag(kafka_topics_factory, tmp_path: Path) -> None:
    settings = kafka_topics_factory(events_partitions=4)
    stream = WorkerStream(workers=8, seed=6)
    register_synthetic(settings, [log.worker_id for log in stream.logs])
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = spawn_router(settings, port, tmp_path / "router.log", snapshot_dir=tmp_path / "snap",
                        snapshot_every_records=5000)
    stop = threading.Event()
    sent = [0]
    counts: dict[str, int] = {}
    threads = [
        threading.Thread(target=_publish, args=(settings, stream, stop, EVENTS_PER_S, sent)),
        threading.Thread(target=_route_loop, args=(base, stream.prompts, stop, counts)),
    ]
    try:
        wait_http(f"{base}/readyz", 60, proc)
        threads[0].start()
        # Route once every worker is known: until then "no eligible worker" is right.
        deadline = time.monotonic() + 60
        # (a registered worker is listed before its first event: count those in the fold)
        while sum("epoch" in w for w in httpx.get(f"{base}/v1/workers", timeout=5).json()["workers"].values()) < len(stream.logs):
            assert time.monotonic() < deadline, "workers never appeared"
            time.sleep(0.1)
        threads[1].start()
        time.sleep(WARMUP_S)
        rss_start = rss_mib(proc.pid)
        steady_from = sent[0]
        time.sleep(STEADY_S)
        rss_end = rss_mib(proc.pid)
        steady_events = sent[0] - steady_from
        stop.set()
        for t in threads:
            t.join(60)
        routed = counts.get("route 200", 0)
        assert proc.poll() is None, "the router died under load"
        assert routed > 0 and set(counts) == {"route 200", "prefill_done 200", "free 200"}, counts

        # A burst: records encoded beforehand, then produced as fast as the client goes,
        # so that the replica falls behind; its lag is sampled all along.
        burst = [stream.next() for _ in range(BURST)]
        lags: list[int] = []
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                lags.append(_total_lag(base))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            p = Producer(producer_config(settings))
            topic = settings.topics.name("events")
            for wid, value in burst:
                p.produce(topic, value, key=wid.to_bytes(8, "big"))
                p.poll(0)
            assert p.flush(60) == 0
            burst_done = time.monotonic()
            while lags[-1:] != [0] or time.monotonic() - burst_done < 0.5:
                assert time.monotonic() - burst_done < LAG_RECOVERY_S, f"lag still {lags[-1]}"
                time.sleep(0.05)
            recovered_s = time.monotonic() - burst_done
        finally:
            sampling.set()
            sampler.join(30)
        peak = max(lags)
        assert wait_http(f"{base}/readyz", 10).json()["ready"] is True
        rss_after_burst = rss_mib(proc.pid)
    finally:
        stop.set()
        stop_process(proc)
        for t in threads:
            if t.ident is not None:
                t.join(60)
    growth = rss_end - rss_start
    print(f"FAULTS load steady_s={STEADY_S} events={steady_events} routed={routed} http={counts} "
          f"rss_start_mib={rss_start:.1f} rss_end_mib={rss_end:.1f} growth_mib={growth:.1f} "
          f"burst={BURST} peak_lag_seen={peak} lag_zero_after_s={recovered_s:.1f} rss_after_burst_mib={rss_after_burst:.1f}")
    assert growth <= RSS_GROWTH_MIB, f"resident memory grew {growth:.1f} MiB under steady load"
