"""``kvstream bench fleet --quick``: routers in front of the same emulated fleet and trace
slice, on the session's broker; every router serves every request, and kvstream's kv
policy finds at least round-robin's share of cached tokens (the engines' own counts).
``--pd 1:1``: each router kind serves every request in two legs, beside its baseline on
whole engines."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

KVSTREAM = str(Path(sys.executable).with_name("kvstream"))
ROUTERS = ("kvstream-kv", "round_robin", "vllm-router-kv_aware")
KEYS = {"ttft_p50_ms", "ttft_p99_ms", "e2e_p99_ms", "requests_per_s", "cached_token_share"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_fleet_quick(kafka_bootstrap: str) -> None:
    proc = subprocess.run(
        [KVSTREAM, "bench", "fleet", "--quick", "--json", "--bootstrap", kafka_bootstrap,
         "--routers", ",".join(ROUTERS), "--loads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=560,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    routers = out["traces"]["conversation"]["routers"]
    assert set(routers) == set(ROUTERS)
    for router, loads in routers.items():
        for row in loads.values():
            assert KEYS <= set(row), router
            assert row["requests"] == out["requests"] and row["failed"] == 0 == row["shed_rate"], (router, row)
            halves = row["halves"]
            assert halves["first"]["requests"] + halves["second"]["requests"] == out["requests"]
    kv, rr = routers["kvstream-kv"]["1x"], routers["round_robin"]["1x"]
    assert kv["cached_token_share"] >= rr["cached_token_share"] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_fleet_approx_replicas_and_restarts(kafka_bootstrap: str) -> None:
    """kvstream with no bridge at all (approximate mode: routed by what it routed) keeps
    at least round-robin's cached share, here on a socket the bench holds and passes
    (systemd socket activation); a peer runs as four processes; and with --restart each
    router has one process killed at half and started again: what was sent to it
    meanwhile fails (counted), the requests after it are served."""
    routers = ("kvstream-kv-approx-socket", "round_robin", "sglang-router-cache_aware-4-replicas")
    proc = subprocess.run(
        [KVSTREAM, "bench", "fleet", "--quick", "--json", "--bootstrap", kafka_bootstrap, "--replayer", "sdk",
         "--routers", ",".join(routers), "--loads", "1", "--restart"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=860,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["traces"]["conversation"]["routers"]
    assert set(rows) == {*routers, *(f"{r}-restarted" for r in routers if r != "round_robin")}
    approx, rr = rows["kvstream-kv-approx-socket"]["1x"], rows["round_robin"]["1x"]
    assert approx["failed"] == 0 and approx["cached_token_share"] >= rr["cached_token_share"] > 0
    for name in ("kvstream-kv-approx-socket-restarted", "sglang-router-cache_aware-4-replicas-restarted"):
        row = rows[name]["1x"]
        assert row["restart"]["down_s"] > 0, name
        assert row["halves"]["second"]["failed"] < row["halves"]["second"]["requests"], name
        assert row["shed_rate"] == round(row["failed"] / row["requests"], 4)


#: A router of each kind in PD mode, with kvstream's hand-off (None: the default, nixl; the
#: peers drive their own), and the repeats.
PD_CASES = [("kvstream-kv", None, 2), ("kvstream-ttft", "bootstrap", 1), ("kvstream-kv-approx", "bootstrap", 1),
            ("vllm-router-kv_aware", None, 1), ("sglang-router-cache_aware", None, 1)]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("router", "handoff", "repeats"), PD_CASES,
                         ids=[f"{r}-{h}" if h else r for r, h, _ in PD_CASES])
def test_bench_fleet_pd(kafka_bootstrap: str, router: str, handoff: str | None, repeats: int) -> None:
    """One prefill and one decode engine: every request is answered through both legs (the
    decode engine made first tokens), and so by the same router in front of two whole
    engines; on whole engines the answers' cached tokens are the engines' own counters',
    under PD the answer's count is at least the prefill engine's (it is the decode
    engine's, which counts the KV it received as cached, or the prefill leg's, which
    vllm-router relays). round_robin, which has no PD mode, is skipped. With repeats,
    each row is the median of its runs."""
    proc = subprocess.run(
        [KVSTREAM, "bench", "fleet", "--pd", "1:1", *(["--pd-handoff", handoff] if handoff else []),
         "--requests", "30", "--loads", "1", "--no-kill-engine", "--replayer", "sdk", "--json",
         "--repeats", str(repeats),
         "--bootstrap", kafka_bootstrap, "--routers", f"{router},round_robin"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["engines"] == 2 and out["pd"]["prefill"] == out["pd"]["decode"] == 1
    assert out["pd"]["handoff"] == {"kvstream": handoff or "nixl", "vllm-router": "nixl", "sglang-router": "bootstrap"}
    assert set(out["skipped"]) == {"round_robin"}
    rows = out["traces"]["conversation"]["routers"]
    assert set(rows) == {router, f"{router}-whole"}
    pd, whole = rows[router]["1x"], rows[f"{router}-whole"]["1x"]
    for row in (pd, whole):
        assert row["requests"] == 30 and row["failed"] == 0, row
        assert 0 <= row["prefill_cached_share"] <= 1
    assert pd["decode_engine_ttft_mean_ms"] is not None and whole["decode_engine_ttft_mean_ms"] is None
    assert whole["cached_token_share"] == pytest.approx(whole["prefill_cached_share"], abs=0.01)
    assert pd["cached_token_share"] >= pd["prefill_cached_share"]
    if repeats > 1:
        for row in (pd, whole):
            runs = [r["prefill_cached_share"] for r in row["runs"]]
            assert len(runs) == repeats and row["prefill_cached_share"] == round(statistics.median(runs), 4)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_fleet_dp(kafka_bootstrap: str) -> None:
    """Two engines of two DP ranks each against four single-rank engines: every request
    answered; kvstream sends each request to the rank its prediction names (what it
    predicted cached is what the engines found cached, rank by rank), and keeps about
    the share it keeps on single-rank engines."""
    proc = subprocess.run(
        [KVSTREAM, "bench", "fleet", "--dp", "2", "--engines", "4", "--traces", "agentic", "--requests", "60",
         "--loads", "1", "--no-kill-engine", "--replayer", "sdk", "--json", "--bootstrap", kafka_bootstrap,
         "--routers", "kvstream-ttft,vllm-router-kv_aware"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=230,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["dp"]["ranks"] == 2 and out["dp"]["engines"] == 2
    rows = out["traces"]["agentic"]["routers"]
    assert set(rows) == {"kvstream-ttft", "kvstream-ttft-single-rank", "vllm-router-kv_aware",
                         "vllm-router-kv_aware-single-rank"}
    for row in rows.values():
        assert row["1x"]["requests"] == 60 and row["1x"]["failed"] == 0, row
    dp, single = rows["kvstream-ttft"]["1x"], rows["kvstream-ttft-single-rank"]["1x"]
    assert dp["prefill_cached_share"] > 0.5
    assert dp["router_predicted_share"] == pytest.approx(dp["prefill_cached_share"], abs=0.02)
    assert dp["prefill_cached_share"] == pytest.approx(single["prefill_cached_share"], abs=0.05)
