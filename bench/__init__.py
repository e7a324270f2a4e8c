"""The benchmark harness behind ``kvstream bench NAME``: benchmarks of the hot paths
(DESIGN.md §11).

Each prints one JSON object whose figures and baseline come from the same run; compare
ratios, not absolute times, on shared machines. It lives beside the package, not in it
(kvstream.tools.bench_cmd finds it when run from a checkout).
"""

from __future__ import annotations

import click

from kvstream.cli import LazyGroup

BENCHES: dict[str, str] = {
    "hashing": "bench.hashing:hashing_bench",
    "index": "bench.index:index_bench",
    "route": "bench.route:route_bench",
    "codec": "bench.codec:codec_bench",
    "publish": "bench.publish:publish_bench",
    "offload": "bench.offload:offload_bench",
    "pipeline": "bench.pipeline:pipeline_bench",
    "restart": "bench.restart:restart_bench",
    "http": "bench.http:http_bench",
    "gateway": "bench.gateway:gateway_bench",
    "tokenize": "bench.tokenize:tokenize_bench",
    "ingest": "bench.ingest:ingest_bench",
    "emulate": "bench.emulate:emulate_bench",
    "fleet": "bench.fleet:fleet_bench",
    "fleet-scale": "bench.fleet_scale:fleet_scale_bench",
}


@click.group(cls=LazyGroup, lazy=BENCHES)
def bench() -> None:
    """Benchmarks; each prints one JSON object (with --json) or a short table."""
