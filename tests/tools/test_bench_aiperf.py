"""``kvstream bench fleet``'s third-party replayer: aiperf (pinned, in its own cached venv)
replays a slice of the conversation trace through a kvstream replica in front of two
emulated engines, and what it reports agrees with the engines' own counters: every
request it counts reached an engine, its prompts have the lengths the bench asked for in
the engines' tokenizer, and the prompts of equal hash ids were cached by the engines at
the share aiperf reports from their usage."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from bench.fleet import front
from bench.replayers import AiperfReplayer, aiperf_venv, aiperf_venv_dir
from kvstream.tools import fleet
from kvstream.tools.procs import free_port


def _venv_or_skip() -> None:
    """Builds the venv once (cached under ~/.cache); skips only when it is not built yet
    and PyPI cannot be reached, so nothing could build it."""
    if not (aiperf_venv_dir() / ".installed").is_file():
        try:
            socket.create_connection(("pypi.org", 443), timeout=5).close()
        except OSError as exc:
            pytest.skip(f"aiperf's venv ({aiperf_venv_dir()}) is not built and PyPI is unreachable: {exc}")
    aiperf_venv()


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


@pytest.mark.timeout(600)
def test_aiperf_through_a_replica_agrees_with_the_engines(kafka_bootstrap: str, tmp_path: Path) -> None:
    _venv_or_skip()
    # No host tier: every cached token the engines report is then a G1 prefix hit.
    scale = fleet.Scale(cpu_blocks=0, tokenizer=fleet.local_tokenizer())
    # 40 requests of the trace at 8x its rate: about two seconds of replay.
    reqs, _ = fleet.load_requests(fleet.default_trace(), 40, 8.0)
    engines = fleet.start_engines(2, scale, 4.0)
    try:
        with front("kvstream-kv", engines, kafka_bootstrap, tmp_path, scale) as fr:
            summary, extra, outcomes = AiperfReplayer().replay(reqs, scale, fr.targets, tmp_path / "replay")
        served = [_metric(e.url, "vllm:request_success_total") for e in engines]
        prompt = sum(_metric(e.url, "vllm:prompt_tokens_total") for e in engines)
        hits = sum(_metric(e.url, "vllm:prefix_cache_hits_total") for e in engines)
    finally:
        fleet.stop_all([e.proc for e in engines])
    assert summary.failed == 0 and summary.requests == len(reqs), summary.errors
    # aiperf's count of successes is the engines' count of finished requests.
    assert sum(served) == len(reqs), served
    # aiperf made the prompts as long as asked, in the engines' own tokenizer (it joins
    # decoded blocks, and a few tokens merge across the joins: 9 of 31,665 here).
    assert prompt == pytest.approx(sum(scale.input_tokens(r) for r in reqs), rel=2e-3)
    # Equal hash ids gave equal text: the engines found prefixes in their caches, and
    # aiperf's share (from their usage) is theirs (from their counters).
    assert hits > 0
    assert summary.cached_token_share == pytest.approx(hits / prompt, abs=1e-9)
    assert summary.ttft_p50_ms <= summary.ttft_p99_ms <= summary.e2e_p99_ms
    assert extra["replay_sched_lag_p99_ms"] is not None
    # Its per-request records (the halves of a run) add up to the engines' counters.
    assert len(outcomes) == len(reqs) and all(o.ok for o in outcomes)
    assert sum(o.prompt_tokens for o in outcomes) == prompt
    assert sum(o.cached_tokens for o in outcomes) == hits


@pytest.mark.timeout(300)
def test_aiperf_counts_the_requests_a_target_refuses(tmp_path: Path) -> None:
    _venv_or_skip()
    scale = fleet.Scale(cpu_blocks=0, tokenizer=fleet.local_tokenizer())
    reqs, _ = fleet.load_requests(fleet.default_trace(), 20, 8.0)
    engines = fleet.start_engines(1, scale, 4.0)
    # Every other request goes to a port nobody listens on.
    refused = f"http://127.0.0.1:{free_port()}"
    try:
        summary, _, outcomes = AiperfReplayer(timeout_s=10).replay(reqs, scale, [engines[0].url, refused], tmp_path)
        served = _metric(engines[0].url, "vllm:request_success_total")
    finally:
        fleet.stop_all([e.proc for e in engines])
    assert summary.requests == len(reqs)
    assert summary.failed == len(reqs) // 2 == len(reqs) - served
    assert any("Connect" in e for e in summary.errors), summary.errors
    # Each record is its request's: the ones sent to the refused port failed.
    assert [o.ok for o in outcomes] == [i % 2 == 0 for i in range(len(reqs))]
