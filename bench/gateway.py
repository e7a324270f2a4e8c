"""``kvstream bench gateway``: what a front costs in front of an OpenAI-compatible
backend, for kvstream's gateway and the peer routers, in the same run (issue 22).

Fronts: ``direct`` (the load generator talks to the backend: the baseline, always run
first), ``kvstream`` (``kvstream router`` with ``[[gateway.workers]]``, on a local broker
or ``--bootstrap``), ``sglang-router`` and ``vllm-router`` (pinned, from their own venv:
bench.peers). Every front stands in front of the same backends
(bench.backend), and the same load generator (oha) drives each in turn:

1. closed loop (``--connections`` keep-alive connections, each sending its next request
   when the last is answered; with several counts, the best is the peak) for
   ``--duration`` seconds, with non-streaming and then streaming ``/v1/completions`` of
   ``--tokens`` tokens (one SSE event each): the peak requests/s;
2. open loop, every front (direct included) at the same rate: half the slowest front's
   peak of that kind (``--rate`` overrides the non-streaming one), so that no front
   queues and the latency it adds is its own work: p50/p99 counted from each request's
   due time, ``--open-loop-repeats`` times with the fronts in turn (the median of the
   runs, each run's figure beside it). ``added_*``: the front's minus direct's, same run.

The front's and the backends' CPU per request come from their process groups during the
closed loops. On a small shared machine the load generator, the front and the backends
share the cores: the figures are relative to the direct baseline of the same run.
Top-level keys without a prefix are kvstream's (null when its front was not run).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import click
import httpx
import numpy as np
import orjson

from kvstream.settings import Settings
from bench.backend import DEFAULT_TOKENS, MODEL, start_backends
from bench.common import emit, json_option
from bench.kafka_env import bootstrap_option, kafka_env
from bench.loadgen import OHA_VERSION, ensure_oha, run_oha
from bench.peers import (
    PeerOptions,
    peer_versions,
    peers_venv,
    start_peer,
)
from kvstream.tools.procs import ManagedProcess, free_port, wait_http
from kvstream.tools.tokenizer_file import TokenizerFetchError, deepseek_tokenizer

FRONTS = ("direct", "kvstream", "sglang-router", "vllm-router")
PATH = "/v1/completions"
KINDS = ("json", "stream")
_WORDS = ("the", "cache", "block", "prefix", "worker", "token", "route", "stream", "fleet", "event",
          "replica", "model", "prompt", "engine", "kafka", "index")


def prompt_bodies(count: int, chars: int, tokens: int, stream: bool, seed: int = 0) -> list[bytes]:
    """``count`` one-line JSON completion bodies: a shared system prefix (half of
    ``chars``) and a distinct rest, as a fleet's traffic looks to a cache-aware router."""
    rng = np.random.default_rng(seed)

    def text(n: int) -> str:
        out = ""
        while len(out) < n:
            out += " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), 64)) + " "
        return out[:n]

    system = text(chars // 2)
    return [
        orjson.dumps({"model": MODEL, "prompt": system + text(chars - chars // 2), "max_tokens": tokens,
                      "stream": stream})
        for _ in range(count)
    ]


def _front_key(front: str) -> str:
    """The prefix of a front's top-level keys (kvstream's have none, as issue 22 names them)."""
    return "" if front == "kvstream" else front.replace("-", "_") + "_"


def require_gateway() -> None:
    if "gateway" not in Settings.model_fields:
        raise click.ClickException(
            "the kvstream front needs kvstream's OpenAI gateway (issue 22: [gateway] settings, /v1/completions "
            "on the replica), which this build lacks; run the others with --fronts direct,sglang-router,vllm-router"
        )


@contextmanager
def kvstream_front(
    backends: Sequence[str], bootstrap: str | None, ready_timeout: float, tokenize: str = "engine",
) -> Iterator[ManagedProcess]:
    """``kvstream router`` serving the OpenAI API with the backends as static workers;
    ``tokenize``: ``engine`` (each prompt sent to the backend's ``/tokenize`` first: its
    tokens are the prompt's bytes, free to compute) or ``local`` (the model's tokenizer
    file in the gateway, as a fleet with tokenizer files runs it: the DeepSeek
    ``tokenizer.json`` of kvstream.tools.tokenizer_file, ~280 µs of the gateway's CPU for a
    2,000-character prompt of the bench, which has no added tokens to cache at). Bodies go
    as the client sent them (``send_token_ids = false``): every front then asks the same
    work of the backend, whose tokenizing is free, where an engine's is not."""
    require_gateway()
    if tokenize == "local":
        try:
            tokenizer = deepseek_tokenizer()
        except TokenizerFetchError as exc:
            raise click.ClickException(f"{exc} (or run with --kvstream-tokenize engine)") from None
    with kafka_env(bootstrap) as settings, tempfile.TemporaryDirectory(prefix="kvstream-bench-gw-") as tmp:
        port = free_port()
        q = json.dumps  # a JSON string is a TOML basic string
        workers = "".join(
            f"[[gateway.workers]]\nid = {i}\nurl = {q(url)}\nmodels = [{q(MODEL)}]\n\n" for i, url in enumerate(backends)
        )
        config = Path(tmp) / "kvstream.toml"
        config.write_text(
            f"bootstrap = {q(settings.bootstrap)}\n\n"
            f"[topics]\nprefix = {q(settings.topics.prefix)}\n\n"
            f"[replica]\nhost = \"127.0.0.1\"\nport = {port}\nsnapshot_dir = {q(str(Path(tmp) / 'snapshots'))}\n\n"
            f"[gateway]\ntokenize = {q(tokenize)}\nsend_token_ids = false\n\n{workers}"
            + (f"[[gateway.models]]\nname = {q(MODEL)}\ntokenizer = {q(str(tokenizer))}\n" if tokenize == "local" else "")
        )
        # Warnings only, as the peers run (``--log-level warn``): the gateway's line per
        # request is an INFO one.
        cmd = [sys.executable, "-c", "from kvstream.cli import main; main()", "--log-level", "WARNING",
               "router", "--config", str(config)]
        proc = ManagedProcess.start("kvstream-router", cmd, port)
        try:
            wait_http(proc, "/readyz", ready_timeout)
            probe = orjson.dumps({"model": MODEL, "prompt": "probe", "max_tokens": 1})
            r = httpx.post(proc.url + PATH, content=probe, headers={"content-type": "application/json"}, timeout=30)
            if r.status_code != 200:
                raise click.ClickException(
                    f"kvstream router answered {r.status_code} to POST {PATH} (is the gateway in this build?): "
                    f"{r.text[:300]}\n{proc.log_tail()}"
                )
            yield proc
        finally:
            proc.stop()


@contextmanager
def start_front(
    front: str, backends: Sequence[ManagedProcess], policies: dict[str, str], bootstrap: str | None,
    ready_timeout: float, tokenize: str = "engine",
) -> Iterator[tuple[str, ManagedProcess | None]]:
    """The front's base URL and its process (None for ``direct``)."""
    urls = tuple(b.url for b in backends)
    if front == "direct":
        yield urls[0], None
    elif front == "kvstream":
        with kvstream_front(urls, bootstrap, ready_timeout, tokenize) as proc:
            yield proc.url, proc
    else:
        with start_peer(PeerOptions(front, policies[front], urls), ready_timeout=ready_timeout) as proc:
            yield proc.url, proc


def _cpu(procs: Sequence[ManagedProcess]) -> float:
    return sum(p.cpu_seconds() for p in procs)


def closed_loop(
    url: str, proc: ManagedProcess | None, backends: Sequence[ManagedProcess], bodies: dict[str, list[bytes]],
    connections: Sequence[int], duration: float,
) -> dict[str, Any]:
    """Peak requests/s of each kind (the best over the ``connections`` counts), and the
    CPU the front and the backends spent per request in that best run."""
    out: dict[str, Any] = {}
    front = [proc] if proc else []
    for kind in KINDS:
        runs = []
        for n in connections:
            front0, back0 = _cpu(front), _cpu(backends)
            r = run_oha(url, PATH, bodies[kind], "application/json", None, n, duration)
            runs.append((r, n, _cpu(front) - front0, _cpu(backends) - back0))
        r, n, front_s, back_s = max(runs, key=lambda run: run[0]["requests_per_s"])
        out[f"{kind}_requests_per_s"] = r["requests_per_s"]
        out[f"{kind}_requests_per_s_by_connections"] = {str(c): run["requests_per_s"] for run, c, _, _ in runs}
        out[f"{kind}_peak_connections"] = n
        out[f"{kind}_closed_loop_p50_us"] = r["p50_us"]
        out[f"{kind}_closed_loop_p99_us"] = r["p99_us"]
        out[f"{kind}_front_cpu_us_per_request"] = round(front_s / r["requests"] * 1e6, 1) if proc else None
        out[f"{kind}_backend_cpu_us_per_request"] = round(back_s / r["requests"] * 1e6, 1)
    return out


def open_loop(
    url: str, bodies: dict[str, list[bytes]], rates: dict[str, float], connections: int, duration: float,
) -> dict[str, Any]:
    """p50/p99 latency of each kind at its rate, counted from each request's due time."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        r = run_oha(url, PATH, bodies[kind], "application/json", rates[kind], connections, duration)
        out[f"{kind}_open_loop_rate_per_s"] = round(rates[kind])
        out[f"{kind}_open_loop_achieved_per_s"] = r["requests_per_s"]
        out[f"{kind}_p50_us"] = r["p50_us"]
        out[f"{kind}_p99_us"] = r["p99_us"]
    return out


def median_of_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One front's open loops repeated: the median of each latency and rate, and every
    run's p50/p99 under ``*_runs`` (a p99 of a few thousand requests moves with any
    hiccup of a shared machine; the median of runs interleaved with the other fronts'
    does not favour one front)."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = values[0] if key.endswith("_rate_per_s") else round(float(np.median(values)))
        if len(runs) > 1 and key.endswith(("_p50_us", "_p99_us")):
            out[key + "_runs"] = values
    return out


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


@click.command("gateway")
@json_option
@click.option(
    "--fronts", default=",".join(FRONTS), show_default=True,
    help="Comma-separated fronts to measure (direct, the baseline, is always run first).",
)
@click.option("--backends", "n_backends", default=1, show_default=True,
              help="Backend processes behind every front (direct talks to the first one).")
@click.option("--tokens", default=DEFAULT_TOKENS, show_default=True, help="Output tokens per request (SSE events).")
@click.option("--prompts", "n_prompts", default=64, show_default=True, help="Distinct prompts, cycled.")
@click.option("--prompt-chars", default=2000, show_default=True, help="Prompt length (half a shared prefix).")
# Fronts peak at different concurrencies: sglang-router's streams each waited ~40 ms for
# oha's delayed ACK at low concurrency (32 connections capped it near 32 / 40 ms), while
# vllm-router spent more CPU per stream at 128.
@click.option("--connections", default="32,128", show_default=True,
              help="Keep-alive connections of the closed loop; several (comma-separated): the best is the peak.")
@click.option("--open-loop-connections", default=64, show_default=True, help="oha's connections (at most) in the open loop.")
@click.option("--duration", default=5.0, show_default=True, help="Seconds of each load run.")
@click.option("--open-loop-repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Open loops per front, the fronts in turn; latencies are the median of the runs.")
@click.option("--rate", type=float, help="Open-loop rate of non-streaming requests [half the slowest front's peak].")
@click.option("--sglang-policy", type=click.Choice(["cache_aware", "round_robin"]), default="cache_aware", show_default=True)
@click.option("--vllm-policy", type=click.Choice(["cache_aware", "round_robin"]), default="cache_aware", show_default=True)
@click.option(
    "--kvstream-tokenize", type=click.Choice(["engine", "local"]), default="engine", show_default=True,
    help="Where kvstream's gateway gets a prompt's token ids: the backend's /tokenize (one more round trip per "
         "request) or a local tokenizer file (the DeepSeek tokenizer.json, tokenized in the gateway).",
)
@click.option("--ready-timeout", default=120.0, show_default=True, help="Seconds a front may take to come up.")
@bootstrap_option
def gateway_bench(
    as_json: bool, fronts: str, n_backends: int, tokens: int, n_prompts: int, prompt_chars: int, connections: str,
    open_loop_connections: int, duration: float, open_loop_repeats: int, rate: float | None, sglang_policy: str,
    vllm_policy: str, kvstream_tokenize: str, ready_timeout: float, bootstrap: str | None,
) -> None:
    """Added latency and throughput of kvstream's gateway, sglang-router and vllm-router
    against calling the backend directly, in the same run with the same load generator."""
    chosen = [f.strip() for f in fronts.split(",") if f.strip()]
    unknown = sorted(set(chosen) - set(FRONTS))
    if unknown:
        raise click.BadParameter(f"unknown fronts {unknown}; known: {', '.join(FRONTS)}", param_hint="--fronts")
    order = ["direct", *dict.fromkeys(f for f in chosen if f != "direct")]
    try:
        counts = [int(c) for c in connections.split(",") if c.strip()]
    except ValueError:
        raise click.BadParameter(f"not a list of integers: {connections!r}", param_hint="--connections") from None
    if not counts or min(counts) < 1:
        raise click.BadParameter("must name at least one count, each >= 1", param_hint="--connections")
    if n_backends < 1 or tokens < 1 or n_prompts < 1 or duration <= 0 or open_loop_connections < 1:
        raise click.BadParameter("--backends, --tokens, --prompts, --open-loop-connections and --duration must be positive")
    if rate is not None and rate <= 0:
        raise click.BadParameter("must be positive", param_hint="--rate")
    if "kvstream" in order:
        require_gateway()
    ensure_oha()
    if any(f in ("sglang-router", "vllm-router") for f in order):
        peers_venv()  # installed before anything is timed
    bodies = {kind: prompt_bodies(n_prompts, prompt_chars, tokens, kind == "stream") for kind in KINDS}
    policies = {"sglang-router": sglang_policy, "vllm-router": vllm_policy}
    load_before = _loadavg()
    results: dict[str, dict[str, Any]] = {}
    with start_backends(n_backends, tokens) as backends, ExitStack() as stack:
        # Every front stays up for the whole run (idle ones cost next to nothing), so
        # that the open loops can run at a rate chosen from all the peaks.
        started = {}
        for front in order:
            click.echo(f"starting {front}...", err=True)
            started[front] = stack.enter_context(
                start_front(front, backends, policies, bootstrap, ready_timeout, kvstream_tokenize)
            )
        for front, (url, proc) in started.items():
            click.echo(f"closed loop: {front}...", err=True)
            results[front] = closed_loop(url, proc, backends, bodies, counts, duration)
        # Half the slowest front's peak: a rate at which no front queues, so that the
        # latency added is the front's work, not its backlog.
        rates = {k: min(r[f"{k}_requests_per_s"] for r in results.values()) / 2 for k in KINDS}
        if rate is not None:
            rates["json"] = rate
        runs: dict[str, list[dict[str, Any]]] = {front: [] for front in started}
        for i in range(open_loop_repeats):  # the fronts in turn, each round
            for front, (url, _proc) in started.items():
                click.echo(f"open loop {i + 1}/{open_loop_repeats}: {front}...", err=True)
                runs[front].append(open_loop(url, bodies, rates, open_loop_connections, duration))
        for front in started:
            results[front].update(median_of_runs(runs[front]))
    direct = results["direct"]
    for front, r in results.items():
        if front != "direct":
            for kind, tag in zip(KINDS, ("", "stream_")):
                for q in ("p50", "p99"):
                    r[f"added_{tag}{q}_us"] = r[f"{kind}_{q}_us"] - direct[f"{kind}_{q}_us"]
            r["json_requests_per_s_vs_direct"] = round(r["json_requests_per_s"] / direct["json_requests_per_s"], 3)
            r["stream_requests_per_s_vs_direct"] = round(r["stream_requests_per_s"] / direct["stream_requests_per_s"], 3)
        if front in policies:
            r["policy"] = policies[front]
    flat: dict[str, Any] = {}
    for front in FRONTS:
        if front == "direct":
            continue
        r = results.get(front, {})
        key = _front_key(front)
        for name in ("added_p50_us", "added_p99_us", "added_stream_p50_us", "added_stream_p99_us",
                     "json_requests_per_s", "stream_requests_per_s"):
            flat[key + name] = r.get(name)
    sglang = results.get("sglang-router")
    kv = results.get("kvstream")
    emit({
        "bench": "gateway",
        **flat,
        "direct_json_requests_per_s": direct["json_requests_per_s"],
        "direct_stream_requests_per_s": direct["stream_requests_per_s"],
        "stream_ratio_vs_sglang_router": (
            round(kv["stream_requests_per_s"] / sglang["stream_requests_per_s"], 3) if kv and sglang else None
        ),
        "open_loop_rates_per_s": {k: round(v) for k, v in rates.items()},
        "fronts": results,
        "kvstream_tokenize": kvstream_tokenize if kv else None,
        "backends": n_backends,
        "tokens": tokens,
        "prompt_chars": prompt_chars,
        "duration_s": duration,
        "open_loop_repeats": open_loop_repeats,
        "connections": counts,
        "load_generator": f"oha {OHA_VERSION}",
        "peer_versions": peer_versions(),
        "cpu_count": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
    }, as_json)
