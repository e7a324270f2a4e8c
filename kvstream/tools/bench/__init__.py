"""``kvstream bench NAME``: benchmarks of the hot paths (DESIGN.md §11).

Each prints one JSON object whose figures and baseline come from the same run; compare
ratios, not absolute times, on shared machines.
"""

from __future__ import annotations

import click

from kvstream.cli import LazyGroup

BENCHES: dict[str, str] = {
    "hashing": "kvstream.tools.bench.hashing:hashing_bench",
    "index": "kvstream.tools.bench.index:index_bench",
    "route": "kvstream.tools.bench.route:route_bench",
    "codec": "kvstream.tools.bench.codec:codec_bench",
    "publish": "kvstream.tools.bench.publish:publish_bench",
    "offload": "kvstream.tools.bench.offload:offload_bench",
    "pipeline": "kvstream.tools.bench.pipeline:pipeline_bench",
    "restart": "kvstream.tools.bench.restart:restart_bench",
    "http": "kvstream.tools.bench.http:http_bench",
    "gateway": "kvstream.tools.bench.gateway:gateway_bench",
    "tokenize": "kvstream.tools.bench.tokenize:tokenize_bench",
    "ingest": "kvstream.tools.bench.ingest:ingest_bench",
    "emulate": "kvstream.tools.bench.emulate:emulate_bench",
    "fleet": "kvstream.tools.bench.fleet:fleet_bench",
}


@click.group(cls=LazyGroup, lazy=BENCHES)
def bench() -> None:
    """Benchmarks; each prints one JSON object (with --json) or a short table."""
