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
