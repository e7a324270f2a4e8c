"""Every ``kvstream bench`` command not covered elsewhere runs at a tiny size and prints
one JSON object with its documented keys and a baseline from the same run."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvstream.tools.bench import bench


def run(args: list[str]) -> dict:
    out = CliRunner().invoke(bench, args)
    assert out.exit_code == 0, out.output
    return json.loads(out.output.strip().splitlines()[-1])


def test_hashing_bench() -> None:
    r = run(["hashing", "--json", "--tokens", "2048"])
    assert r["kernel"] == "native"
    assert r["us_per_prompt"] > 0 and r["baseline_us_per_prompt"] > 0
    assert r["speedup"] == pytest.approx(r["baseline_us_per_prompt"] / r["us_per_prompt"], rel=0.02)


def test_index_and_route_benches() -> None:
    r = run(["index", "--json", "--blocks", "20000", "--workers", "8", "--queries", "100", "--prompt-blocks", "160"])
    for key in ("apply_blocks_per_s", "match_p50_us", "match_p99_us"):
        assert r[key] > 0, key
    assert r["bytes_per_block"] >= 0  # an RSS delta: at this tiny size it may round to 0
    r = run(["route", "--json", "--blocks", "20000", "--workers", "8", "--requests", "50", "--prompt-blocks", "160"])
    for key in ("route_p50_us", "route_p99_us", "decisions_per_s"):
        assert r[key] > 0, key
    assert r["route_p99_us"] >= r["route_p50_us"]


@pytest.mark.slow
def test_publish_bench(kafka_bootstrap: str) -> None:
    r = run(["publish", "--json", "--bootstrap", kafka_bootstrap, "--messages", "300"])
    assert r["block_events"] >= 300 * 16
    assert r["blocks_per_s"] > 0 and r["baseline_blocks_per_s"] > 0
    # Random hashes do not compress: at least 8 bytes (a removed block) per block event.
    assert r["wire_bytes_per_block_event"] >= 8 and r["baseline_wire_bytes_per_block_event"] >= 8
    assert r["records_per_produce_request"] >= 1
