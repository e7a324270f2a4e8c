"""``kvstream bench fleet --quick``: routers in front of the same emulated fleet and trace
slice, on the session's broker; every router serves every request, and kvstream's kv
policy finds at least round-robin's share of cached tokens (the engines' own counts)."""

from __future__ import annotations

import json
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
    at least round-robin's cached share; a peer runs as four processes; and with
    --restart each router has one process killed at half and started again: what was
    sent to it meanwhile fails (counted), the requests after it are served."""
    routers = ("kvstream-kv-approx", "round_robin", "sglang-router-cache_aware-4-replicas")
    proc = subprocess.run(
        [KVSTREAM, "bench", "fleet", "--quick", "--json", "--bootstrap", kafka_bootstrap, "--replayer", "sdk",
         "--routers", ",".join(routers), "--loads", "1", "--restart"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=860,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["traces"]["conversation"]["routers"]
    assert set(rows) == {*routers, *(f"{r}-restarted" for r in routers if r != "round_robin")}
    approx, rr = rows["kvstream-kv-approx"]["1x"], rows["round_robin"]["1x"]
    assert approx["failed"] == 0 and approx["cached_token_share"] >= rr["cached_token_share"] > 0
    for name in ("kvstream-kv-approx-restarted", "sglang-router-cache_aware-4-replicas-restarted"):
        row = rows[name]["1x"]
        assert row["restart"]["down_s"] > 0, name
        assert row["halves"]["second"]["failed"] < row["halves"]["second"]["requests"], name
        assert row["shed_rate"] == round(row["failed"] / row["requests"], 4)
