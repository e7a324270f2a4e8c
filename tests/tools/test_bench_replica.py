"""The replica benchmarks (pipeline, restart, http) at a tiny size against the real
broker: each prints one JSON object whose figures are present and plausible. Speed
itself is not asserted (it is measured by running the benchmarks)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvstream.tools.bench import bench

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


def run_bench(*args: str) -> dict:
    result = CliRunner().invoke(bench, [*args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    # stdout carries exactly one JSON object (progress goes to stderr).
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0])


def positive(out: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(out[key], int | float) and out[key] > 0, (key, out[key])


def test_pipeline_bench(kafka_bootstrap: str) -> None:
    out = run_bench(
        "pipeline", "--bootstrap", kafka_bootstrap, "--blocks", "20000", "--workers", "2",
        "--prompt-blocks", "64", "--capacity", "4000", "--partitions", "2", "--seconds", "1",
    )
    assert out["bench"] == "pipeline"
    positive(out, "blocks_per_s", "baseline_blocks_per_s", "replay_blocks_per_s", "ratio_to_baseline")
    # Stores of 64-block prompts plus the evictions once a worker holds 4000 blocks.
    assert 19_000 < out["block_events"] < 40_000
    assert 0 < out["lag_p50_ms"] <= out["lag_p99_ms"] <= out["lag_max_ms"]
    assert out["lag_records"] > 0
    assert out["delivery_failures"] == 0


def test_restart_bench(kafka_bootstrap: str) -> None:
    out = run_bench(
        "restart", "--bootstrap", kafka_bootstrap, "--blocks", "20000", "--workers", "8", "--partitions", "2",
    )
    assert out["bench"] == "restart"
    assert 19_000 <= out["blocks"] <= 21_000
    assert sum(out["tier_blocks"].values()) == out["blocks"]
    positive(out, "ready_from_snapshot_s", "ready_from_replay_s", "speedup", "snapshot_write_s", "snapshot_bytes")
    assert out["events_applied_after_restore"] == 0  # restored at the end of the log
    assert out["events_replayed"] > 0
    assert out["speedup"] == pytest.approx(out["ready_from_replay_s"] / out["ready_from_snapshot_s"], rel=0.02)
    assert set(out["restore_breakdown_s"]) == {"read_and_verify", "unpack", "index_import"}


def test_http_bench(kafka_bootstrap: str) -> None:
    out = run_bench(
        "http", "--bootstrap", kafka_bootstrap, "--blocks", "20000", "--workers", "8", "--prompts", "10",
        "--requests", "40", "--clients", "2", "--partitions", "2", "--load-generator", "python",
    )
    assert out["bench"] == "http"
    assert out["prompt_tokens"] == 8192
    positive(out, "route_p50_us", "route_p99_us", "requests_per_s", "baseline_route_p50_us", "baseline_decisions_per_s")
    assert out["route_p50_us"] <= out["route_p99_us"]
    # A loopback round trip with JSON of 8k token ids cannot beat the in-process call.
    assert out["route_p50_us"] > out["baseline_route_p50_us"]


# wrk and oha are installed by the benchmark when absent: oha compiles from source (minutes).
@pytest.mark.timeout(1800)
def test_http_bench_with_wrk_and_oha(kafka_bootstrap: str) -> None:
    out = run_bench(
        "http", "--bootstrap", kafka_bootstrap, "--blocks", "20000", "--workers", "8", "--prompts", "10",
        "--clients", "2", "--partitions", "2", "--duration", "1",
    )
    assert out["load_generator"] == "wrk"
    for fmt in ("json", "binary"):
        positive(out, f"{fmt}_requests_per_s", f"{fmt}_p50_us", f"{fmt}_p99_us", f"{fmt}_http_to_in_process_ratio")
        assert out[f"{fmt}_p50_us"] <= out[f"{fmt}_p99_us"]
        # The open loop runs at half the closed loop's rate, every request answered 200.
        positive(out, f"{fmt}_open_loop_achieved_per_s", f"{fmt}_open_loop_p50_us", f"{fmt}_open_loop_requests")
        assert out[f"{fmt}_open_loop_rate_per_s"] == round(out[f"{fmt}_requests_per_s"] / 2)
        assert out[f"{fmt}_open_loop_p50_us"] <= out[f"{fmt}_open_loop_p99_us"]
    positive(out, "in_process_list_decisions_per_s", "in_process_bytes_decisions_per_s")
