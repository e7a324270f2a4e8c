"""``kvstream bench emulate``: what emulated engines (``kvstream emulate``, real processes
on loopback, ``--engines`` of them side by side) cost in CPU and how closely their
wall-clock time follows the cost model, on a batch of requests sharing a prefix.

Baseline, in the same run: the emulator's own scheduler and cost model run offline on the
same requests (no sleeping, no HTTP), which gives the modelled makespan and cached-token
share. The live run sends the requests at once over HTTP (aiohttp, one connection each)
to every engine and reports the wall time against the modelled one, the emulator
processes' CPU time (user + system, from /proc, summed) per wall second and per thousand
generated tokens, and the cached-token share from the responses' usage.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import click

from bench.common import emit, json_option
from kvstream.emulator.blocks import BlockPool
from kvstream.emulator.options import EmulatorOptions
from kvstream.emulator.scheduler import EngineRequest, Scheduler
from kvstream.tools.procs import free_port


def _workload(n: int, prompt: int, shared: int) -> list[list[int]]:
    head = list(range(1, shared + 1))
    return [head + [(shared + 1 + i * prompt + j) % 128_000 for j in range(prompt - shared)] for i in range(n)]


def _offline(prompts: list[list[int]], out: int, options: EmulatorOptions) -> tuple[float, float]:
    """Modelled makespan (s) and cached-token share of the batch, all arriving at once."""
    s = Scheduler(BlockPool(options.num_gpu_blocks, options.block_size), options.cost)
    reqs = [EngineRequest(str(i), p, out, 0.0) for i, p in enumerate(prompts)]
    for r in reqs:
        s.add(r)
    ms = 0.0
    while s.has_work:
        step = s.schedule()
        ms += step.ms(options.cost)
        s.complete(step)
    return ms / 1000, sum(r.cached_tokens or 0 for r in reqs) / sum(len(p) for p in prompts)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _live(url: str, prompts: list[list[int]], out: int, stream: bool) -> list[dict[str, Any]]:
    async def one(session: aiohttp.ClientSession, p: list[int]) -> dict[str, Any]:
        body = {"prompt": p, "max_tokens": out, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise click.ClickException(f"the emulator answered {r.status}: {await r.text()}")
            if not stream:
                return dict((await r.json())["usage"])
            last = None
            async for line in r.content:
                if line.startswith(b"data: {"):
                    last = line
            if last is None:
                raise click.ClickException("a stream ended without its usage chunk")
            return dict(json.loads(last[6:])["usage"])

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        return await asyncio.gather(*[one(session, p) for p in prompts])


def _start(speed: float) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("kvstream")), "emulate", "--port", str(port), "--speed", str(speed)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc: subprocess.Popen[str], url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise click.ClickException(f"kvstream emulate exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            urllib.request.urlopen(url + "/health", timeout=5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise click.ClickException("kvstream emulate never answered /health") from None
            time.sleep(0.1)


async def _all(urls: list[str], prompts: list[list[int]], out: int, stream: bool) -> list[list[dict[str, Any]]]:
    return list(await asyncio.gather(*[_live(u, prompts, out, stream) for u in urls]))


@click.command("emulate")
@click.option("--requests", "n", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests sent at once to each engine.")
@click.option("--prompt-tokens", type=click.IntRange(min=2), default=2000, show_default=True)
@click.option("--shared-tokens", type=click.IntRange(min=0), default=1024, show_default=True,
              help="The prefix every prompt shares.")
@click.option("--output-tokens", type=click.IntRange(min=1), default=300, show_default=True)
@click.option("--speed", type=float, default=1.0, show_default=True, help="The emulator's --speed.")
@click.option("--engines", type=click.IntRange(min=1), default=1, show_default=True,
              help="Emulator processes run side by side, each with the same requests.")
@click.option("--stream/--no-stream", default=True, show_default=True)
@json_option
def emulate_bench(n: int, prompt_tokens: int, shared_tokens: int, output_tokens: int, speed: float, engines: int,
                  stream: bool, as_json: bool) -> None:
    """Emulated engines' CPU cost and timing fidelity against their own cost model."""
    if shared_tokens >= prompt_tokens:
        raise click.BadParameter("--shared-tokens must be below --prompt-tokens")
    options = EmulatorOptions(speed=speed)
    prompts = _workload(n, prompt_tokens, shared_tokens)
    model_s, model_share = _offline(prompts, output_tokens, options)
    procs: list[subprocess.Popen[str]] = []
    try:
        urls = []
        for _ in range(engines):
            proc, url = _start(speed)
            procs.append(proc)
            urls.append(url)
        for proc, url in zip(procs, urls, strict=True):
            _wait_healthy(proc, url)
        cpu0, t0 = [_cpu_s(p.pid) for p in procs], time.monotonic()
        per_engine = asyncio.run(_all(urls, prompts, output_tokens, stream))
        wall = time.monotonic() - t0
        cpu = sum(_cpu_s(p.pid) - c for p, c in zip(procs, cpu0, strict=True))
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    usages = [u for us in per_engine for u in us]
    generated = sum(u["completion_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    emit({
        "bench": "emulate", "engines": engines, "requests": n, "prompt_tokens": prompt_tokens,
        "shared_tokens": shared_tokens, "output_tokens": output_tokens, "speed": speed, "stream": stream,
        "model_makespan_s": round(model_s / speed, 3), "wall_s": round(wall, 3),
        "wall_over_model": round(wall / (model_s / speed), 3),
        "emulator_cpu_s": round(cpu, 3), "emulator_cpu_share": round(cpu / wall, 4),
        "emulator_cpu_ms_per_1k_generated_tokens": round(cpu * 1e6 / generated, 2),
        "cached_token_share": round(cached / (engines * sum(len(p) for p in prompts)), 4),
        "model_cached_token_share": round(model_share, 4),
    }, as_json)
