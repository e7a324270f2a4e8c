"""``kvstream bench fleet``: kvstream head to head with the peer routers, in front of the
same emulated fleet, on the same trace slice (issue 23 item 3).

Every router gets a fresh set of engines (cold caches) and the same requests, replayed
by kvstream.tools.fleet's asyncio ``openai``-SDK replayer at each ``--speeds`` factor
(the engines run as fast, so the load is the trace's). Routers: ``kvstream-kv``,
``kvstream-ttft`` (one replica each), ``kvstream-ttft-4-replicas`` (four replicas, the
replayer sending to them in turn: a plain round-robin balancer), ``vllm-router-kv_aware``
(fed every engine's ZMQ KV events), ``vllm-router-cache_aware``,
``sglang-router-cache_aware`` (pinned, kvstream.tools.bench.peers) and ``round_robin``
(the replayer sending to the engines in turn). The replayer is kvstream's own: no
third-party trace replayer was installed and tried in the time this bench was written.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import click

from kvstream.kafka.topics import ensure_topics
from kvstream.settings import Settings, TopicSettings
from kvstream.tools import fleet
from kvstream.tools.bench.common import emit, json_option
from kvstream.tools.bench.kafka_env import bootstrap_option, broker
from kvstream.tools.bench.peers import PeerOptions, peer_versions, start_peer

ROUTERS = ("kvstream-kv", "kvstream-ttft", "kvstream-ttft-4-replicas", "vllm-router-kv_aware",
           "vllm-router-cache_aware", "sglang-router-cache_aware", "round_robin")


@contextmanager
def _front(router: str, engines: list[fleet.Engine], bootstrap: str, work: Path) -> Iterator[tuple[Callable[[int], str], list[Any]]]:
    """A chooser of base URLs for request i, and the router processes (for their CPU)."""
    urls = [e.url for e in engines]
    with ExitStack() as stack:
        if router == "round_robin":
            yield (lambda i: urls[i % len(urls)]), []
            return
        if router.startswith(("vllm-router", "sglang-router")):
            peer, _, policy = router.rpartition("-")
            opts = PeerOptions(peer, policy, tuple(urls),
                               {e.url: e.events for e in engines} if policy == "kv_aware" else None,
                               fleet.MODEL if policy == "kv_aware" else None)
            proc = stack.enter_context(start_peer(opts))
            yield (lambda i: proc.url), [proc]
            return
        prefix = f"fleet.{uuid.uuid4().hex[:8]}."
        ensure_topics(Settings(bootstrap=bootstrap, topics=TopicSettings(prefix=prefix)))
        bridges = [fleet.start_bridge(e, bootstrap, prefix) for e in engines]
        stack.callback(fleet.stop_all, bridges)
        policy = "kv" if router == "kvstream-kv" else "ttft"
        replicas = [fleet.Replica(str(n), bootstrap, prefix, policy, work / f"{prefix}{n}")
                    for n in range(4 if router.endswith("4-replicas") else 1)]
        for r in replicas:
            r.start()
            stack.callback(r.stop)
        for r in replicas:
            r.wait_ready(len(engines))
        yield (lambda i: replicas[i % len(replicas)].url), [r.proc for r in replicas]


@click.command("fleet")
@click.option("--engines", "n_engines", default=8, show_default=True, type=click.IntRange(1, 16))
@click.option("--requests", default=400, show_default=True, type=click.IntRange(10))
@click.option("--speeds", default="4,8", show_default=True, help="Trace speed factors, light to heavy.")
@click.option("--routers", default=",".join(ROUTERS), show_default=True)
@click.option("--trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--quick", is_flag=True, help="2 engines, 120 requests, one speed (for tests).")
@bootstrap_option
@json_option
def fleet_bench(n_engines: int, requests: int, speeds: str, routers: str, trace: Path | None, quick: bool,
                bootstrap: str | None, as_json: bool) -> None:
    """Routers head to head in front of the same emulated fleet and trace slice."""
    chosen = [r.strip() for r in routers.split(",") if r.strip()]
    unknown = sorted(set(chosen) - set(ROUTERS))
    if unknown:
        raise click.ClickException(f"unknown routers {unknown}; known: {', '.join(ROUTERS)}")
    try:
        factors = [float(s) for s in speeds.split(",")]
    except ValueError:
        raise click.ClickException(f"--speeds must be numbers separated by commas, got {speeds!r}") from None
    if quick:
        n_engines, requests, factors = min(n_engines, 2), 120, factors[:1]
    trace = trace or fleet.default_trace()
    scale = fleet.Scale()
    out: dict[str, Any] = {"engines": n_engines, "requests": requests, "speeds": factors, "peers": peer_versions(),
                           "replayer": "kvstream.tools.fleet (openai SDK, asyncio)", "routers": {}}
    with broker(bootstrap) as servers:
        with tempfile.TemporaryDirectory(prefix="kvstream-bench-fleet-") as tmp:
            for router in chosen:
                out["routers"][router] = {}
                for speed in factors:
                    reqs, out["trace"] = fleet.load_requests(trace, requests, speed)
                    engines = fleet.start_engines(n_engines, scale, speed)
                    try:
                        with _front(router, engines, servers, Path(tmp)) as (choose, procs):
                            cpu0 = sum(p.cpu_seconds() for p in procs)
                            s = fleet.replay(reqs, scale, choose)
                            cpu = sum(p.cpu_seconds() for p in procs) - cpu0
                    finally:
                        fleet.stop_all([e.proc for e in engines])
                    row = s.as_dict() | {"router_cpu_s": round(cpu, 2), "loadavg": fleet.loadavg()}
                    out["routers"][router][f"{speed:g}x"] = row
                    click.echo(f"{router} {speed:g}x: {row}", err=True)
    emit(out, as_json)
