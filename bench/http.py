"""``kvstream bench http``: routing over the replica's HTTP API (served as ``kvstream
router`` serves it, on loopback) against the same decisions through the in-process
``Replica.route``, in the same run (DESIGN.md §9, §11).

State: the ``kvstream bench index`` workload (``--blocks`` over ``--workers`` workers,
lower tiers included) with each block's local hash made the hash of real tokens, written
to the events topic as workers publish it and folded by a real replica. Requests: 8k-token
prompts (a held conversation continued with fresh tokens), ``query_only`` so that the
load does not grow. By default ``wrk`` (compiled; installed with apt-get when absent)
sends them over ``--clients`` keep-alive connections for ``--duration`` seconds (closed
loop: the most requests/s), once as JSON and once as binary bodies (little-endian u32);
then ``oha`` (compiled; built with cargo when absent) sends each format at half the rate
wrk reached (open loop: the p99 at that rate, counted from each request's due time).
``--load-generator python`` uses threads with httpx connections in a child process
instead (JSON only; the Python client is itself a limit). Latency is the client's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import click
import httpx
import numpy as np
import orjson
import uvicorn

from kvstream.events.model import Stored
from kvstream.hashing import local_hashes
from kvstream.replica.cli import freeze_heap, http_limits, server_config
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.replica.service import create_app
from kvstream.settings import Settings
from bench.common import emit, json_option, percentiles_us, time_calls
from bench.index import make_workload
from bench.kafka_env import bootstrap_option, kafka_env, produce_records, wait_settled
from kvstream.worker.announce import register_synthetic
from bench.restart import replica_options, worker_log
from bench.loadgen import ensure_oha, ensure_wrk, run_oha, run_wrk

VOCAB = 152_064


def token_workload(
    n_blocks: int, n_workers: int, n_prompts: int, block_size: int, seed: int
) -> tuple[list[Stored], list[list[int]], int]:
    """The index workload with real tokens: every distinct local hash is replaced by the
    local hash of ``block_size`` random tokens, so that token prompts match it. Returns
    the stored events, the prompts (token ids) and the number of indexed blocks."""
    w = make_workload(n_blocks, n_workers, 32, 32, 512, n_prompts, seed)
    distinct = list(dict.fromkeys(h for ev in w.events for h in ev.tokens_hashes))
    distinct += list(dict.fromkeys(h for local, _ in w.queries for h in local))
    distinct = list(dict.fromkeys(distinct))
    rng = np.random.default_rng(seed + 1)
    tokens = rng.integers(0, VOCAB, (len(distinct), block_size), dtype=np.uint32)
    real = local_hashes(tokens.ravel(), block_size)
    rekey = dict(zip(distinct, real))
    row = {h: i for i, h in enumerate(distinct)}
    events = [
        Stored(
            ev.worker_id, ev.dp_rank, ev.tier, ev.epoch, ev.event_id, ev.parent_hash, ev.block_hashes,
            tuple(rekey[h] for h in ev.tokens_hashes),
        )
        for ev in w.events
    ]
    prompts = [tokens[[row[h] for h in local]].ravel().tolist() for local, _ in w.queries]
    return events, prompts, w.blocks


# -- clients (child process) ---------------------------------------------------------------


def _clients_main(url: str, bodies: list[bytes], clients: int, requests: int, conn: Connection) -> None:
    """Send ``requests`` requests from ``clients`` threads; report per-request latencies
    (ns), the answers' chosen logits by body index, the wall time and any failures."""
    lat: list[int] = []
    logits: dict[int, float] = {}
    failures: list[str] = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def client() -> None:
        headers = {"content-type": "application/json"}
        # Without TCP_NODELAY, the body (sent after the headers) waits for the server's
        # delayed ACK of the headers: +40 ms per request on Linux.
        transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        with httpx.Client(base_url=url, timeout=60, transport=transport) as http:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                body = bodies[i % len(bodies)]
                t0 = time.perf_counter_ns()
                try:
                    r = http.post("/v1/route", content=body, headers=headers)
                    answer = orjson.loads(r.content)
                except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                dt = time.perf_counter_ns() - t0
                with lock:
                    if r.status_code != 200:
                        failures.append(f"{r.status_code}: {r.text[:200]}")
                    else:
                        lat.append(dt)
                        logits[i % len(bodies)] = answer["logit"]

    try:
        threads = [threading.Thread(target=client) for _ in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        conn.send(("ok", (lat, logits, time.perf_counter() - t0, failures)))
    except Exception as exc:  # report to the parent rather than die silently
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def run_clients(url: str, bodies: list[bytes], clients: int, requests: int, timeout: float) -> tuple[Any, ...]:
    ctx = mp.get_context("spawn")  # the parent runs Kafka clients' threads: never fork it
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_clients_main, args=(url, bodies, clients, requests, child), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise click.ClickException(f"the clients did not finish within {timeout:.0f}s")
        status, value = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status != "ok":
        raise click.ClickException(f"client process failed: {value}")
    return value


class Server:
    """The replica's app served on a free loopback port, in a thread, as ``kvstream
    router`` serves it (its uvicorn configuration and HTTP limits, default settings)."""

    def __init__(self, replica: Replica, settings: Settings) -> None:
        # proto IPPROTO_TCP, as getaddrinfo gives when uvicorn binds itself: asyncio sets
        # TCP_NODELAY on accepted connections only then (else each response waits for
        # the client's delayed ACK, +40 ms).
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; we keep the socket
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        limits = http_limits(settings)
        config = server_config(
            create_app(replica, limits=limits), settings, limits,
            lambda limit: replica.metrics.http_rejected.labels(limit=limit).inc(),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> Server:
        freeze_heap()  # as kvstream router does before it serves
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise click.ClickException("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()


@click.command("http")
@bootstrap_option
@click.option("--blocks", "n_blocks", default=200_000, show_default=True, help="Indexed blocks.")
@click.option("--workers", "n_workers", default=64, show_default=True)
@click.option("--prompts", "n_prompts", default=200, show_default=True, help="Distinct 8k-token prompts.")
@click.option("--requests", "n_requests", default=2000, show_default=True, help="Requests of --load-generator python.")
@click.option("--clients", default=4, show_default=True, help="Concurrent clients (wrk: keep-alive connections).")
@click.option(
    "--load-generator", type=click.Choice(["wrk", "python"]), default="wrk", show_default=True,
    help="wrk (compiled, installed with apt-get when absent) for both body formats, or "
    "the Python httpx clients (JSON only).",
)
@click.option("--duration", default=10.0, show_default=True, help="Seconds of load per body format and loop.")
@click.option(
    "--open-loop/--no-open-loop", default=True, show_default=True,
    help="After wrk, oha (compiled; built with cargo install when absent) sends each format "
    "at a fixed rate, half wrk's, for the p99 at that rate.",
)
@click.option(
    "--open-loop-rate", type=click.FloatRange(min=1), default=None,
    help="Requests/s of the open loop, every format [default: half what wrk reached for it].",
)
@click.option("--open-loop-connections", default=32, show_default=True, help="oha's connections (at most).")
@click.option("--partitions", default=12, show_default=True)
@click.option("--timeout", default=600.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@json_option
def http_bench(
    bootstrap: str | None,
    n_blocks: int,
    n_workers: int,
    n_prompts: int,
    n_requests: int,
    clients: int,
    load_generator: str,
    duration: float,
    open_loop: bool,
    open_loop_rate: float | None,
    open_loop_connections: int,
    partitions: int,
    timeout: float,
    seed: int,
    as_json: bool,
) -> None:
    """POST /v1/route requests/s and latency (closed loop), p99 at half that rate (open
    loop), vs. in-process Replica.route in the same run."""
    load_start = os.getloadavg()[0]
    if load_generator == "wrk":
        ensure_wrk()  # before the minutes of setup
        if open_loop:
            ensure_oha()
    click.echo(f"building an index workload of {n_blocks:,} blocks...", err=True)
    events, prompts, blocks = token_workload(n_blocks, n_workers, n_prompts, 16, seed)
    records = worker_log(events)
    del events
    bodies = [orjson.dumps({"token_ids": p, "query_only": True}) for p in prompts]
    with kafka_env(bootstrap, events_partitions=partitions) as settings:
        produce_records(settings, records, "writing the log")
        register_synthetic(settings, (wid for wid, _ in records))  # routers admit registered workers only
        # The default readiness threshold: the replica's own log-clock ticks must not make
        # it refuse requests while the clients run.
        replica = Replica(settings, replace(replica_options(None), ready_max_lag=ReplicaOptions().ready_max_lag))
        replica.start()
        try:
            wait_settled(replica, settings, timeout, "replica folding the log")
            if load_generator == "wrk":
                result = _measure_wrk(
                    replica, settings, prompts, clients, duration, open_loop, open_loop_rate, open_loop_connections
                )
            else:
                result = _measure(replica, settings, prompts, bodies, n_requests, clients, timeout)
        finally:
            replica.stop()
    emit(
        {
            "bench": "http",
            "blocks": blocks,
            "workers": n_workers,
            "prompt_tokens": len(prompts[0]),
            "prompts": len(prompts),
            "clients": clients,
            "load_generator": load_generator,
            **({"requests": n_requests} if load_generator == "python" else {}),
            **result,
            # Other jobs on the machine share its cores with the server and the clients.
            "load_average_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        },
        as_json,
    )


def _measure(
    replica: Replica,
    settings: Settings,
    prompts: Sequence[list[int]],
    bodies: list[bytes],
    n_requests: int,
    clients: int,
    timeout: float,
) -> dict[str, Any]:
    # Baseline: the same decisions in-process, one after another.
    expected = [replica.route(p, query_only=True).chosen.logit for p in prompts]
    it = iter(range(n_requests))
    samples = time_calls(lambda: replica.route(prompts[next(it) % len(prompts)], query_only=True), n_requests)
    base_p50, base_p99 = percentiles_us(samples, 50, 99)
    base_rate = n_requests / (sum(samples) / 1e9)

    with Server(replica, settings) as server:
        click.echo(f"{clients} clients sending {n_requests} requests to {server.url}...", err=True)
        lat, logits, wall_s, failures = run_clients(server.url, bodies, clients, n_requests, timeout)
    if failures:
        raise click.ClickException(f"{len(failures)} requests failed, e.g. {failures[0]}")
    wrong = [i for i, logit in logits.items() if logit != expected[i]]
    if wrong:
        raise click.ClickException(f"{len(wrong)} HTTP decisions differ from the in-process ones (prompt {wrong[0]})")
    p50, p99 = percentiles_us(lat, 50, 99)
    rate = len(lat) / wall_s
    return {
        "route_p50_us": p50,
        "route_p99_us": p99,
        "requests_per_s": round(rate),
        "baseline": "Replica.route in-process, same prompts, sequential",
        "baseline_route_p50_us": base_p50,
        "baseline_route_p99_us": base_p99,
        "baseline_decisions_per_s": round(base_rate),
        "p50_ratio_to_baseline": round(p50 / base_p50, 2),
        "throughput_ratio_to_baseline": round(rate / base_rate, 3),
    }


def _measure_wrk(
    replica: Replica,
    settings: Settings,
    prompts: Sequence[list[int]],
    connections: int,
    duration: float,
    open_loop: bool,
    open_loop_rate: float | None,
    open_loop_connections: int,
) -> dict[str, Any]:
    """wrk against the server for JSON and binary bodies, then oha (at half wrk's rate
    unless ``open_loop_rate`` is given); the in-process decision rate (sequential, from
    lists and from bytes) in the same run."""
    packed = [np.asarray(p, dtype="<u4").tobytes() for p in prompts]
    in_process = {}
    for name, inputs in (("list", prompts), ("bytes", packed)):
        n = max(200, len(inputs))
        it = iter(range(n))
        samples = time_calls(lambda: replica.route(inputs[next(it) % len(inputs)], query_only=True), n)
        in_process[name] = (n / (sum(samples) / 1e9), *percentiles_us(samples, 50, 99))
    formats = {
        "json": ("/v1/route", "application/json", [orjson.dumps({"token_ids": p, "query_only": True}) for p in prompts]),
        "binary": ("/v1/route?query_only=true", "application/octet-stream", packed),
    }
    out: dict[str, Any] = {}
    with Server(replica, settings) as server:
        # One answer of each format checked against the in-process decision first.
        with httpx.Client(base_url=server.url, timeout=60) as http:
            want = replica.route(prompts[0], query_only=True).chosen.logit
            for path, ctype, bodies in formats.values():
                got = http.post(path, content=bodies[0], headers={"content-type": ctype})
                if got.status_code != 200 or got.json()["logit"] != want:
                    raise click.ClickException(f"{ctype} answer differs from in-process: {got.text[:200]}")
        for name, (path, ctype, bodies) in formats.items():
            click.echo(f"wrk: {connections} connections, {duration:g}s of {name} bodies...", err=True)
            # This process's CPU time while it only serves (wrk is another process): the
            # server's cost per request, which other jobs on the machine do not inflate
            # as they do latency.
            cpu0 = time.process_time()
            r = run_wrk(server.url, path, bodies, ctype, connections, min(connections, 2), duration)
            cpu = time.process_time() - cpu0
            base_rate = in_process["list" if name == "json" else "bytes"][0]
            out |= {
                f"{name}_requests_per_s": r["requests_per_s"],
                f"{name}_p50_us": r["p50_us"],
                f"{name}_p99_us": r["p99_us"],
                f"{name}_requests": r["requests"],
                f"{name}_server_cpu_us_per_request": round(cpu / r["requests"] * 1e6),
                f"{name}_http_to_in_process_ratio": round(r["requests_per_s"] / base_rate, 3),
            }
        if open_loop:
            # Binary first: a JSON rate the server cannot keep up with (as a fixed
            # --open-loop-rate may be) leaves a queue that would delay the next run.
            for name in ("binary", "json"):
                path, ctype, bodies = formats[name]
                rate = open_loop_rate or out[f"{name}_requests_per_s"] / 2
                # oha reads one body per line: JSON bodies cycle, a binary prompt is sent alone.
                sent = bodies if name == "json" else bodies[:1]
                click.echo(f"oha: {rate:.0f} {name} requests/s for {duration:g}s (open loop)...", err=True)
                r = run_oha(server.url, path, sent, ctype, rate, open_loop_connections, duration)
                out |= {
                    f"{name}_open_loop_rate_per_s": round(rate),
                    f"{name}_open_loop_achieved_per_s": r["requests_per_s"],
                    f"{name}_open_loop_p50_us": r["p50_us"],
                    f"{name}_open_loop_p99_us": r["p99_us"],
                    f"{name}_open_loop_requests": r["requests"],
                }
    return {
        **out,
        "baseline": "Replica.route in-process, same prompts, sequential (lists for JSON, bytes for binary)",
        "in_process_list_decisions_per_s": round(in_process["list"][0]),
        "in_process_list_p50_us": in_process["list"][1],
        "in_process_bytes_decisions_per_s": round(in_process["bytes"][0]),
        "in_process_bytes_p50_us": in_process["bytes"][1],
    }
