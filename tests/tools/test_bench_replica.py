"""The replica benchmarks (pipeline, restart, http) at a tiny size against the real
broker: each prints one JSON object whose figures are present and stand where they
should against the baseline measured in the same run (with room for a noisy machine;
the speed itself is measured by running the benchmarks at full size)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bench import bench

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


def run_bench(*args: str) -> dict:
    result = CliRunner().invoke(bench, [*args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    # stdout carries exactly one JSON object (progress goes to stderr).
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0])


def test_pipeline_bench(kafka_bootstrap: str) -> None:
    out = run_bench(
        "pipeline", "--bootstrap", kafka_bootstrap, "--blocks", "20000", "--workers", "2",
        "--prompt-blocks", "64", "--capacity", "4000", "--partitions", "2", "--seconds", "1",
    )
    assert out["bench"] == "pipeline"
    # Publish, decode and apply against a bare consume of the same records (0.03 at full
    # size). At this size neither ratio is bounded: the baseline and the replay are mostly
    # the consumer's start (0.09-2.0 seen for the pipeline, 0.25-0.54 for the replay), so
    # only that each ratio is its two figures' is asserted.
    assert out["ratio_to_baseline"] == pytest.approx(out["blocks_per_s"] / out["baseline_blocks_per_s"], rel=0.02, abs=1e-3)
    assert out["replay_ratio_to_baseline"] == pytest.approx(
        out["replay_blocks_per_s"] / out["baseline_blocks_per_s"], rel=0.02, abs=1e-3)
    # Stores of 64-block prompts plus the evictions once a worker holds 4000 blocks.
    assert 19_000 < out["block_events"] < 40_000
    assert 0 < out["lag_p50_ms"] <= out["lag_p99_ms"] <= out["lag_max_ms"]
    assert out["lag_records"] > 0
    assert out["delivery_failures"] == 0


def test_restart_bench(kafka_bootstrap: str) -> None:
    out = run_bench(
        "restart", "--bootstrap", kafka_bootstrap, "--blocks", "100000", "--workers", "8", "--partitions", "2",
    )
    assert out["bench"] == "restart"
    assert 95_000 <= out["blocks"] <= 105_000
    assert sum(out["tier_blocks"].values()) == out["blocks"]
    # Ready from the snapshot costs less CPU than replaying the log (1.5x at this size,
    # where the consumer's start is much of both; 2.5-4x at full size).
    assert out["cpu_speedup"] == pytest.approx(out["ready_from_replay_cpu_s"] / out["ready_from_snapshot_cpu_s"], rel=0.05, abs=0.01)
    assert out["cpu_speedup"] > 1, out
    assert out["snapshot_bytes"] > 0
    assert out["events_applied_after_restore"] == 0  # restored at the end of the log
    assert out["events_replayed"] > 0
    assert out["speedup"] == pytest.approx(out["ready_from_replay_s"] / out["ready_from_snapshot_s"], rel=0.02)
    assert set(out["restore_breakdown_s"]) == {"read_and_verify", "index_import"}


def test_http_bench(kafka_bootstrap: str) -> None:
    out = run_bench(
        "http", "--bootstrap", kafka_bootstrap, "--blocks", "20000", "--workers", "8", "--prompts", "10",
        "--requests", "40", "--clients", "2", "--partitions", "2", "--load-generator", "python",
    )
    assert out["bench"] == "http"
    assert out["prompt_tokens"] == 8192
    assert out["route_p50_us"] <= out["route_p99_us"]
    # A loopback round trip with JSON of 8k token ids cannot beat the in-process call.
    assert out["route_p50_us"] > out["baseline_route_p50_us"]
    assert out["throughput_ratio_to_baseline"] == pytest.approx(
        out["requests_per_s"] / out["baseline_decisions_per_s"], rel=0.05, abs=1e-3)
    assert 0 < out["throughput_ratio_to_baseline"] < 1, out


# wrk and oha are installed by the benchmark when absent: oha compiles from source (minutes).
@pytest.mark.timeout(1800)
def test_http_bench_with_wrk_and_oha(kafka_bootstrap: str) -> None:
    out = run_bench(
        "http", "--bootstrap", kafka_bootstrap, "--blocks", "20000", "--workers", "8", "--prompts", "10",
        "--clients", "2", "--partitions", "2", "--duration", "1",
    )
    assert out["load_generator"] == "wrk"
    for fmt, body in (("json", "list"), ("binary", "bytes")):
        assert out[f"{fmt}_p50_us"] <= out[f"{fmt}_p99_us"]
        # HTTP on loopback against the in-process call with the same prompts: fewer
        # decisions per second (0.1-0.25 measured), each slower.
        assert out[f"{fmt}_http_to_in_process_ratio"] == pytest.approx(
            out[f"{fmt}_requests_per_s"] / out[f"in_process_{body}_decisions_per_s"], rel=0.05, abs=1e-3)
        assert 0 < out[f"{fmt}_http_to_in_process_ratio"] < 1, out
        assert out[f"{fmt}_p50_us"] > out[f"in_process_{body}_p50_us"], out
        # The open loop runs at half the closed loop's rate, every request answered 200,
        # and keeps up with it.
        assert out[f"{fmt}_open_loop_rate_per_s"] == round(out[f"{fmt}_requests_per_s"] / 2)
        assert out[f"{fmt}_open_loop_requests"] > 0
        assert out[f"{fmt}_open_loop_achieved_per_s"] >= 0.5 * out[f"{fmt}_open_loop_rate_per_s"], out
        assert out[f"{fmt}_open_loop_p50_us"] <= out[f"{fmt}_open_loop_p99_us"]
