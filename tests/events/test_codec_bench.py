"""``kvstream bench codec`` runs and reports what it promises (speed itself is not tested)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from bench.codec import codec_bench


def test_codec_bench_json() -> None:
    result = CliRunner().invoke(
        codec_bench, ["--batches", "3", "--events-per-batch", "4", "--blocks", "5", "--rounds", "1", "--json"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["bench"] == "codec" and out["blocks_per_event"] == 5
    for key in ("encode_events_per_s", "decode_events_per_s", "decode_blocks_per_s", "baseline_wire_decode_events_per_s"):
        assert out[key] > 0
    assert abs(out["decode_blocks_per_s"] - 5 * out["decode_events_per_s"]) <= 5  # both rounded
    assert out["wire_decode_speedup"] > 0
    # 5 packed hashes take 40 bytes each side; array<long> zigzag varints of random u64 take more.
    assert out["bytes_per_event"] < out["baseline_bytes_per_event"]
    assert set(out["unpack_ns_per_hash_list"]) == {"struct", "numpy_frombuffer_tolist", "array_Q"}
