"""``kvstream bench emulate`` at a tiny size: one JSON object, its offline baseline from
the same run, the emulator's wall time never ahead of its own cost model."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvstream.tools.bench import bench


def test_emulate_bench() -> None:
    out = CliRunner().invoke(bench, ["emulate", "--json", "--requests", "4", "--prompt-tokens", "64",
                                     "--shared-tokens", "32", "--output-tokens", "8", "--speed", "20"])
    assert out.exit_code == 0, out.output
    r = json.loads(out.output.strip().splitlines()[-1])
    assert r["bench"] == "emulate" and r["requests"] == 4
    assert r["model_makespan_s"] > 0 and r["wall_s"] >= r["model_makespan_s"] * 0.95
    assert r["emulator_cpu_s"] > 0 and r["emulator_cpu_ms_per_1k_generated_tokens"] > 0
    assert 0 < r["cached_token_share"] <= 0.5  # at most the shared half of every prompt
