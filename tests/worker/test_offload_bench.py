"""``kvstream bench offload``: one JSON object with every path and its baseline (the
figures themselves are measured by running the benchmark, not here)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")

from bench.offload import offload_bench  # noqa: E402


def test_bench_reports_every_path(tmp_path):
    args = ["--device", "cpu", "--blocks", "4", "--block-mib", "0.0625", "--batch", "2", "--rounds", "1", "--dir", str(tmp_path), "--json"]
    result = CliRunner().invoke(offload_bench, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert out["bench"] == "offload" and out["blocks"] == 4 and out["block_bytes"] == 65536
    for path in ("g1_to_g2", "g2_to_g3", "g3_to_g1"):
        p = out["paths"][path]
        assert p["gbps"] > 0 and p["baseline_gbps"] > 0
        assert p["ratio"] == pytest.approx(p["gbps"] / p["baseline_gbps"], rel=0.002)  # of figures rounded to 4 digits
    assert out["engine"]["written_host"] == 4 and out["engine"]["written_disk"] == 4
    assert out["page_cache"]["dropped_before_reads"] is True
    assert list(tmp_path.iterdir()) == []  # its files are removed


def test_bench_rejects_bad_sizes(tmp_path):
    result = CliRunner().invoke(offload_bench, ["--device", "cpu", "--batch", "0", "--dir", str(tmp_path)])
    assert result.exit_code != 0 and "batch_blocks" in result.output
    result = CliRunner().invoke(offload_bench, ["--device", "cpu", "--blocks", "0"])
    assert result.exit_code != 0 and "must be positive" in result.output
