"""``kvstream bench fleet``: kvstream head to head with the peer routers, in front of the
same emulated fleet, on the same trace slice (issue 23 item 3).

Every router gets a fresh set of engines (cold caches) for each load and the same
requests, replayed by the same replayer (``--replayer``, bench.replayers): ``aiperf``, a
third-party one installed by the bench into its own cached venv, replaying the slice as
a Mooncake trace on its fixed schedule with prompts it makes from the hash ids; or
``sdk``, kvstream's own asyncio ``openai``-SDK replayer. The engines
run ``--engine-speed`` times faster than real time; a load ``L`` of ``--loads`` replays
the trace ``L`` × that fast, so ``L`` is the trace's rate relative to real time. Routers: ``kvstream-kv``,
``kvstream-ttft`` (one replica each), ``kvstream-ttft-4-replicas`` (four replicas, the
replayer sending to them in turn: a plain round-robin balancer), ``vllm-router-kv_aware``
(fed every engine's ZMQ KV events), ``vllm-router-cache_aware``,
``sglang-router-cache_aware`` (pinned, bench.peers) and ``round_robin``
(the replayer sending to the engines in turn). Prompts are text for every router:
sglang-router refuses token-id prompts (422, its request schema); the sdk replayer's
words are one token each at the engines (kvstream.tools.fleet.Scale.text), aiperf's
text is measured in the engines' tokenizer: the same lengths and shared prefixes.

``--kill-engine`` adds the scenario ``kvstream-kv-engine-killed``: engine 1 is killed
with SIGKILL once the engines have taken half of the requests (their own counters,
whichever the replayer); the requests it held fail (each
counted, with its error), the replicas drop it once its lease runs out, and no client
hangs (every request ends within the replayer's timeout).
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import click
import httpx

from bench.common import emit, json_option
from bench.kafka_env import bootstrap_option, broker
from bench.peers import PeerOptions, peer_versions, start_peer
from bench.replayers import REPLAYERS, AiperfReplayer, Replayer, SdkReplayer
from kvstream.kafka.topics import ensure_topics
from kvstream.settings import Settings, TopicSettings
from kvstream.tools import fleet
from kvstream.tools.plotting import pyplot

ROUTERS = ("kvstream-kv", "kvstream-ttft", "kvstream-ttft-4-replicas", "vllm-router-kv_aware",
           "vllm-router-cache_aware", "sglang-router-cache_aware", "round_robin")


@contextmanager
def front(router: str, engines: list[fleet.Engine], bootstrap: str, work: Path,
           tokenizer: Path | None) -> Iterator[tuple[list[str], list[Any]]]:
    """The base URLs the replayer sends to in turn, and the router processes (for their CPU)."""
    urls = [e.url for e in engines]
    with ExitStack() as stack:
        if router == "round_robin":
            yield urls, []
            return
        if router.startswith(("vllm-router", "sglang-router")):
            peer, _, policy = router.rpartition("-")
            opts = PeerOptions(peer, policy, tuple(urls),
                               {e.url: e.events for e in engines} if policy == "kv_aware" else None,
                               fleet.MODEL if policy == "kv_aware" else None)
            proc = stack.enter_context(start_peer(opts))
            yield [proc.url], [proc]
            return
        prefix = f"fleet.{uuid.uuid4().hex[:8]}."
        ensure_topics(Settings(bootstrap=bootstrap, topics=TopicSettings(prefix=prefix)))
        bridges = [fleet.start_bridge(e, bootstrap, prefix) for e in engines]
        stack.callback(fleet.stop_all, bridges)
        policy = "kv" if router == "kvstream-kv" else "ttft"
        replicas = [fleet.Replica(str(n), bootstrap, prefix, policy, work / f"{prefix}{n}", tokenizer)
                    for n in range(4 if router.endswith("4-replicas") else 1)]
        for r in replicas:
            r.start()
            stack.callback(r.stop)
        for r in replicas:
            r.wait_ready(len(engines))
        yield [r.url for r in replicas], [r.proc for r in replicas]


@click.command("fleet")
@click.option("--engines", "n_engines", default=8, show_default=True, type=click.IntRange(1, 16))
@click.option("--requests", default=400, show_default=True, type=click.IntRange(10))
@click.option("--engine-speed", default=4.0, show_default=True, type=click.FloatRange(min=0.1),
              help="The engines run this many times faster than real time.")
@click.option("--loads", default="1,3", show_default=True,
              help="The trace's rate relative to real time, light to heavy (comma-separated).")
@click.option("--kill-engine/--no-kill-engine", default=True, show_default=True,
              help="Also run kvstream-kv at the heaviest load with engine 1 killed mid-run.")
@click.option("--routers", default=",".join(ROUTERS), show_default=True)
@click.option("--trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--quick", is_flag=True, help="2 engines, 120 requests, the first load only, no engine killed (for tests).")
@click.option("--replayer", "replayer_name", type=click.Choice(sorted(REPLAYERS)), default="aiperf", show_default=True,
              help="aiperf: the third-party replayer (installed on first use into a cached venv); "
                   "sdk: kvstream's own openai-SDK replayer.")
@click.option("--token-id-prompts", is_flag=True,
              help="sdk replayer: send token-id prompts instead of words (sglang-router refuses them; half the rate here).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="Also draw TTFT p50/p99 and cached-token share per router and load into this PNG (needs the plot extra: matplotlib).")
@bootstrap_option
@json_option
def fleet_bench(n_engines: int, requests: int, engine_speed: float, loads: str, kill_engine: bool, routers: str,
                trace: Path | None, quick: bool, replayer_name: str, token_id_prompts: bool, plot: Path | None,
                bootstrap: str | None, as_json: bool) -> None:
    """Routers head to head in front of the same emulated fleet and trace slice."""
    if plot is not None:
        pyplot()  # before the runs: a missing extra is said at once
    chosen = [r.strip() for r in routers.split(",") if r.strip()]
    unknown = sorted(set(chosen) - set(ROUTERS))
    if unknown:
        raise click.ClickException(f"unknown routers {unknown}; known: {', '.join(ROUTERS)}")
    try:
        factors = [float(s) for s in loads.split(",")]
    except ValueError:
        raise click.ClickException(f"--loads must be numbers separated by commas, got {loads!r}") from None
    if not factors or min(factors) <= 0:
        raise click.ClickException(f"--loads must be positive numbers, got {loads!r}")
    if token_id_prompts and replayer_name != "sdk":
        raise click.ClickException("--token-id-prompts needs --replayer sdk (aiperf sends text)")
    if quick:
        n_engines, requests, factors, kill_engine = min(n_engines, 2), 120, factors[:1], False
    trace = trace or fleet.default_trace()
    scale = fleet.Scale(tokenizer=fleet.local_tokenizer())
    replayers: dict[bool, Replayer] = (
        {True: AiperfReplayer(), False: AiperfReplayer()} if replayer_name == "aiperf"
        # sglang-router refuses token-id prompts: it gets words whatever the flag says.
        else {True: SdkReplayer(text=True), False: SdkReplayer(text=not token_id_prompts)})
    out: dict[str, Any] = {"engines": n_engines, "requests": requests, "engine_speed": engine_speed, "loads": factors,
                           "peers": peer_versions(), "scale": scale.factor, "tokens_per_id": scale.tokens_per_id,
                           "replayer": {"name": replayer_name, "version": replayers[False].version}, "routers": {}}
    with broker(bootstrap) as servers:
        with tempfile.TemporaryDirectory(prefix="kvstream-bench-fleet-") as tmp:
            runs = [(r, load, False) for r in chosen for load in factors]
            if kill_engine:
                runs.append(("kvstream-kv", max(factors), True))
            for n, (router, load, kill) in enumerate(runs):
                reqs, out["trace"] = fleet.load_requests(trace, requests, engine_speed * load)
                replayer = replayers[router.startswith("sglang")]
                work = Path(tmp) / str(n)
                work.mkdir()
                row = _run(router, reqs, scale, engine_speed, n_engines, servers, work, kill, replayer)
                name = router + ("-engine-killed" if kill else "")
                out["routers"].setdefault(name, {})[f"{load:g}x"] = row
                click.echo(f"{name} load {load:g}x: {row}", err=True)
    if plot is not None:
        draw(out, plot)
    emit(out, as_json)


def draw(out: dict[str, Any], path: Path) -> None:
    """Three panels per load: TTFT p50, TTFT p99, cached-token share, one bar per router."""
    plt = pyplot()
    import numpy as np

    routers = list(out["routers"])
    loads = sorted({load for rows in out["routers"].values() for load in rows}, key=lambda k: float(k[:-1]))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / max(len(routers), 1)
    for ax, key, label in zip(axes, ("ttft_p50_ms", "ttft_p99_ms", "cached_token_share"),
                              ("TTFT p50 (ms, wall clock)", "TTFT p99 (ms, wall clock)", "cached-token share"), strict=True):
        for j, router in enumerate(routers):
            values = [out["routers"][router].get(load, {}).get(key, np.nan) for load in loads]
            ax.bar(np.arange(len(loads)) + j * width, values, width, label=router)
        ax.set_xticks(np.arange(len(loads)) + width * (len(routers) - 1) / 2, [f"load {k}" for k in loads])
        ax.set_title(label)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{out['engines']} emulated engines at {out['engine_speed']:g}x, {out['requests']} requests of the trace, "
                 f"replayed by {out['replayer']['name']} {out['replayer']['version']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run(router: str, reqs: list[Any], scale: fleet.Scale, speed: float, n_engines: int, bootstrap: str, work: Path,
         kill: bool, replayer: Replayer) -> dict[str, Any]:
    """One router at one load on fresh engines: the replay's summary, the routers' CPU."""
    engines = fleet.start_engines(n_engines, scale, speed)
    try:
        with front(router, engines, bootstrap, work, scale.tokenizer) as (targets, procs), ExitStack() as stack:
            if kill:
                stack.enter_context(_kill_at_half(engines, len(reqs)))
            cpu0 = sum(p.cpu_seconds() for p in procs)
            s, extra = replayer.replay(reqs, scale, targets, work / "replay")
            cpu = sum(p.cpu_seconds() for p in procs) - cpu0
        engine_ttft = _engine_ttft_ms(engines[1:] if kill else engines)
    finally:
        fleet.stop_all([e.proc for e in engines])
    return s.as_dict() | extra | {"engine_ttft_mean_ms": engine_ttft, "router_cpu_s": round(cpu, 2),
                                  "loadavg": fleet.loadavg()}


def _engine_ttft_ms(engines: list[fleet.Engine]) -> float | None:
    """The engines' own mean TTFT (``vllm:time_to_first_token_seconds``, from arrival):
    what the replayer's TTFT is beside the router's hop and the client's own time."""
    total = count = 0.0
    with httpx.Client(timeout=10.0) as client:
        for e in engines:
            for line in client.get(e.url + "/metrics").text.splitlines():
                if line.startswith("vllm:time_to_first_token_seconds_sum"):
                    total += float(line.split()[-1])
                elif line.startswith("vllm:time_to_first_token_seconds_count"):
                    count += float(line.split()[-1])
    return round(1000 * total / count, 2) if count else None


#: The engines' samples whose sum is the requests they have taken.
_TAKEN = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:request_success_total")


def _taken(client: httpx.Client, url: str) -> float:
    text = client.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(_TAKEN))


@contextmanager
def _kill_at_half(engines: list[fleet.Engine], total: int, every_s: float = 0.25) -> Iterator[None]:
    """SIGKILL engine 1 (a crash, mid-stream) once the engines have taken half of the
    ``total`` requests, by their own counters (so whatever the replayer)."""
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(timeout=2.0) as client:
            while not done.wait(every_s):
                try:
                    taken = sum(_taken(client, e.url) for e in engines)
                except httpx.HTTPError:
                    continue  # an engine busy past the timeout: ask again
                if taken >= total // 2:
                    os.killpg(engines[0].proc.popen.pid, signal.SIGKILL)
                    return

    thread = threading.Thread(target=watch, name="kill-engine", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
