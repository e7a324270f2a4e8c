"""``kvstream simulate``: the LRU references, per-window hit rates, load sweeps and the
command-line flags of every weight and cost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.cli import cli
from kvstream.hashing import block_hashes
from kvstream.tools.simulate.errors import SimulationError
from kvstream.tools.simulate.reference import lru_reference
from kvstream.tools.simulate.sweep import parse_sweep, saturation, scaled
from kvstream.tools.simulate.trace import Request

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_fast25_conversation_trace.jsonl"


def _request(i: int, ids: list[int]) -> Request:
    return Request(f"r{i}", float(i), len(ids) * 4, 1, tuple(ids), tokens_per_id=4)


def _naive_lru(requests: list[Request], capacity: int) -> list[int]:
    """A plain list-based LRU of single blocks: most recent last, a prompt's blocks used
    from its last to its first (so its first is the most recent)."""
    cache: list[int] = []
    hits = []
    for r in requests:
        _, seqs = block_hashes(r.tokens(), 4)
        n = 0
        while n < len(seqs) and seqs[n] in cache:
            n += 1
        hits.append(n)
        for h in reversed(seqs):
            if h in cache:
                cache.remove(h)
            cache.append(h)
        del cache[: max(0, len(cache) - capacity)]
    return hits


@settings(max_examples=100, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=5), min_size=1, max_size=30),
    capacity=st.integers(1, 12),
)
def test_lru_reference_matches_a_naive_lru(prompts: list[list[int]], capacity: int) -> None:
    reqs = [_request(i, ids) for i, ids in enumerate(prompts)]
    ref = lru_reference(reqs, 4, capacity)
    assert list(ref.hits) == _naive_lru(reqs, capacity)
    assert ref.blocks == tuple(len(p) for p in prompts)
    assert 0 <= ref.rate() <= 1
    # A bigger cache never finds fewer blocks (prefix hits of an LRU stack are monotone).
    assert lru_reference(reqs, 4, capacity + 5).rate() >= ref.rate()
    with pytest.raises(SimulationError):
        lru_reference(reqs, 4, 0)


def test_sweep_spec_and_scaling() -> None:
    assert parse_sweep("speed=4,1,2") == [1, 2, 4]
    for bad in ("rate=1,2", "speed=", "speed=1,x", "speed=0,1", "speed=1,1", "1,2"):
        with pytest.raises(SimulationError, match="--sweep"):
            parse_sweep(bad)
    reqs = [_request(i, [i]) for i in range(3)]
    assert [r.arrival_ms for r in scaled(reqs, 2)] == [0, 0.5, 1]
    with pytest.raises(Exception, match="speed"):
        scaled(reqs, 0)


def _row(policy: str, speed: float, p50: float, simulated_s: float = 10.0) -> dict:
    return {"policy": policy, "speed": speed, "ttft_p50_ms": p50, "ttft_p99_ms": 2 * p50, "ttft_mean_ms": p50,
            "requests": 100, "offered_req_per_s": 10.0 * speed, "simulated_s": simulated_s / speed}


def test_saturation_is_the_first_load_past_either_criterion() -> None:
    rows = [
        _row("round_robin", 1, 100), _row("round_robin", 2, 150), _row("round_robin", 4, 500),  # p50 > 4x
        _row("kv", 1, 80), _row("kv", 2, 90), _row("kv", 4, 100, simulated_s=20.0),  # a 100% backlog
        _row("ttft", 1, 70), _row("ttft", 2, 75), _row("ttft", 4, 90),
    ]
    table = saturation(rows)
    assert table["saturation_speed"] == {"round_robin": 4, "kv": 4, "ttft": None}
    at = table["at_round_robin_saturation"]
    assert (at["speed"], at["best_policy"], at["ttft_p50_ratio"]) == (4, "ttft", round(500 / 90, 2))


def test_cli_sweep_windows_references_and_every_flag(tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["simulate", "--sessions", "8", "--workers", "3", "--policy", "kv", "--policy", "ttft",
            "--device-tokens", "8000", "--no-progress", "--json", "--window", "10"]
    res = runner.invoke(cli, args + ["--sweep", "speed=1,4", "--plot", str(tmp_path / "sweep.png")])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert [(r["speed"], r["policy"]) for r in doc["sweep"]] == [(1, "kv"), (1, "ttft"), (4, "kv"), (4, "ttft")]
    assert set(doc["saturation"]["saturation_speed"]) == {"kv", "ttft"}
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The same runs in separate processes give the same figures, and stdout is the JSON
    # alone (the spawned runs log to stderr like the command does).
    kvstream = Path(sys.executable).with_name("kvstream")
    proc = subprocess.run([str(kvstream), *args, "--sweep", "speed=1,4", "--jobs", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    again = json.loads(proc.stdout)
    assert "offload_closed" in proc.stderr
    volatile = {"wall_s", "events_per_s"}
    assert [{k: v for k, v in r.items() if k not in volatile} for r in again["sweep"]] == [
        {k: v for k, v in r.items() if k not in volatile} for r in doc["sweep"]
    ]
    for run in doc["sweep"]:
        assert 0 <= run["hit_rate"] <= run["upper_bound"] <= 1
        windows = run["windows"]
        assert windows[0]["requests"] == [0, 10] and windows[-1]["requests"][1] == run["requests"]
        assert all({"hit_rate", "upper_bound", "host_lru"} <= w.keys() for w in windows)
    # Every weight and cost is a flag, and reaches the run: a zero prefill cost makes
    # TTFT the minimum step alone.
    res = runner.invoke(cli, args + ["--host-cache-hit-weight", "0.5", "--ttft-recompute-weight", "0",
                                     "--prefill-ms-per-token", "0", "--decode-ms-per-token", "0",
                                     "--decode-ms-per-context-token", "0", "--min-step-ms", "7",
                                     "--onboard-host-ms-per-token", "0", "--onboard-disk-ms-per-token", "0"])
    assert res.exit_code == 0, res.output
    runs = json.loads(res.stdout.strip().splitlines()[-1])["runs"]
    assert {r["ttft_p50_ms"] for r in runs} == {7.0}
    res = runner.invoke(cli, args + ["--max-batch-tokens", "2", "--batch-limit", "4"])
    assert res.exit_code != 0 and "max_batch_tokens" in res.output
    res = runner.invoke(cli, args + ["--router-temperature", "-1"])
    assert res.exit_code != 0 and "router_temperature" in res.output
    res = runner.invoke(cli, args + ["--ttft-rate-scope", "rack"])
    assert res.exit_code != 0 and "ttft-rate-scope" in res.output
    res = runner.invoke(cli, args + ["--sweep", "load=1"])
    assert res.exit_code != 0 and "--sweep" in res.output
    help_text = runner.invoke(cli, ["simulate", "--help"]).output
    for flag in ("--overlap-score-credit", "--prefill-load-scale", "--ttft-prior-tokens-per-s", "--min-step-ms",
                 "--max-batch-tokens", "--decode-ms-per-context-token", "--host-tokens", "--disk-tokens",
                 "--disk-min-seen"):
        assert flag in help_text


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.is_file(), reason=f"the Mooncake trace is not at {TRACE} (../shared/traces of the repo)")
def test_mooncake_trace_window_ttft_beats_kv_beats_round_robin() -> None:
    runner = CliRunner()
    res = runner.invoke(cli, ["simulate", "--trace", str(TRACE), "--limit", "600", "--speed", "2", "--block-size", "512",
                              "--policy", "ttft", "--policy", "kv", "--policy", "round_robin", "--json",
                              "--no-progress", "--window", "300"])
    assert res.exit_code == 0, res.output
    by = {r["policy"]: r for r in json.loads(res.stdout.strip().splitlines()[-1])["runs"]}
    assert by["kv"]["hit_rate"] > by["round_robin"]["hit_rate"]
    assert by["ttft"]["ttft_p50_ms"] < by["kv"]["ttft_p50_ms"] < by["round_robin"]["ttft_p50_ms"]
    assert len(by["kv"]["windows"]) == 2
