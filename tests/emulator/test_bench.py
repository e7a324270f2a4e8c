"""``kvstream bench emulate`` at a tiny size: one JSON object, its offline baseline from
the same run, the emulator's wall time never ahead of its own cost model."""

from __future__ import annotations

import json

from click.testing import CliRunner

from bench import bench


def test_emulate_bench() -> None:
    out = CliRunner().invoke(bench, ["emulate", "--json", "--requests", "4", "--prompt-tokens", "64",
                                     "--shared-tokens", "32", "--output-tokens", "8", "--speed", "20"])
    assert out.exit_code == 0, out.output
    r = json.loads(out.output.strip().splitlines()[-1])
    assert r["bench"] == "emulate" and r["requests"] == 4
    assert r["model_makespan_s"] > 0 and r["wall_s"] >= r["model_makespan_s"] * 0.95
    assert r["emulator_cpu_s"] >= 0  # /proc counts 10 ms ticks: too coarse to bound a tiny run
    # Offline, the first request caches the shared 2 blocks and the 3 others find them.
    assert r["model_cached_token_share"] == 3 * 32 / (4 * 64)
    assert 0 < r["cached_token_share"] <= 0.5  # at most the shared half of every prompt
