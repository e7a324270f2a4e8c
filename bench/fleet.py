"""``kvstream bench fleet``: kvstream head to head with the peer routers, in front of the
same emulated fleet, on the same traces (issue 23 item 3, issue 33 item 4).

Every router gets a fresh set of engines (cold caches) for each run and the same
requests, replayed by the same replayer (``--replayer``, bench.replayers): ``aiperf``, a
third-party one installed by the bench into its own cached venv, replaying the slice as
a Mooncake trace on its fixed schedule with prompts it makes from the hash ids; or
``sdk``, kvstream's own asyncio ``openai``-SDK replayer. The engines run
``--engine-speed`` times faster than real time; a load ``L`` of ``--loads`` replays the
trace ``L`` × that fast, so ``L`` is the trace's rate relative to real time.

Traces (``--traces``): ``conversation``, the Mooncake conversation trace (``--trace``
gives another file), and the generated shapes of kvstream.tools.simulate.shapes
(``agentic``, ``system-prompts``, ``long-docs``), each played the same way.

Routers, by name: ``kvstream-kv`` and ``kvstream-ttft`` (the policy); ``-4-replicas``
after any router's name runs four of its processes, the replayer sending to them in turn
(a plain round-robin balancer), for the peers as for kvstream; ``-approx`` after a
kvstream router runs it with no bridge at all (the engines given in
``[[gateway.workers]]``: routed by the blocks it routed there alone, approximate mode);
``-socket`` (after ``-approx``, before ``-4-replicas``) runs kvstream's replicas on
listening sockets the bench holds and passes them, as systemd socket activation does
(a restart then refuses no connection; the peers have no such mode);
``vllm-router-kv_aware`` (fed every engine's ZMQ KV events), ``vllm-router-cache_aware``,
``sglang-router-cache_aware`` (pinned, bench.peers) and ``round_robin`` (the replayer
sending to the engines in turn). Prompts are text for every router.

Scenarios beside the plain runs, at the heaviest load:
- ``--restart``: for every router, ``<router>-restarted``: one of its processes (for
  kvstream one replica) is killed with SIGKILL once the engines have taken half of the
  requests, and started again at once on the same port; the requests sent to it
  meanwhile fail (the shed rate), and the second half's figures against the first's
  and against the plain run's second half show what a restart cost.
- ``--kill-engine``: ``kvstream-kv-engine-killed``: engine 1 is killed with SIGKILL at
  half; the requests it held fail (each counted, with its error), the replicas drop it
  once its lease runs out, and no client hangs.

Disaggregated serving (``--pd P:D``, issue 34): every router runs in front of P prefill
engines (``kvstream emulate --role prefill``) and D decode engines (``--role decode``),
each request in two legs, the prefill engine handing the prompt's KV to the decode
engine: kvstream's gateways by the hand-off of ``--pd-handoff`` (the engines' bridges
register role, hand-off and bootstrap port), ``vllm-router`` by vLLM's NixlConnector
(``nixl``, ``--vllm-pd-disaggregation``), ``sglang-router`` by SGLang's bootstrap server
(``bootstrap``, ``--pd-disaggregation``; bench.peers). Beside each router's row, its
baseline ``<router>-whole``: the same router in front of P+D whole engines, in the same
run and the same turns. ``round_robin`` has no PD mode (nothing pairs the legs): it is
skipped, said under ``skipped``. ``--restart`` and ``--kill-engine`` run on the
disaggregated fleet (the engine killed is a prefill engine).

Data-parallel engines (``--dp N``, issue 34): every engine process serves N DP ranks
behind its one server (``kvstream emulate --data-parallel-size N``, each rank its own
cache and KV events on its own port), ``--engines`` ÷ N of them; kvstream's bridges
publish every rank's events and the gateways route each request to a rank
(``X-data-parallel-rank``), ``vllm-router`` kv_aware reads every rank's events, the other
peers send to the engine, which balances its ranks itself. Beside each router's row, its
baseline ``<router>-single-rank``: the same router in front of ``--engines`` engines of
one rank each (the same ranks, caches and capacity), in the same run and turns.

``--repeats K`` plays every run K times, the routers in turn (A B C A B C ...), and
reports each figure's median beside every run's. Each row has ``shed_rate`` (failed ÷
sent) beside the latencies, and ``halves``: the first and second half of the requests'
own figures (per-request records). Two cached shares: ``cached_token_share``, from the
answers' usage (``prompt_tokens_details.cached_tokens``), is what the router relays:
whole engines' own count; under PD the decode engine's (kvstream, sglang-router), which
counts the prompt tokens it received from the prefill engine as cached, so it is near 1
whatever the routing, or the prefill leg's (vllm-router puts it in the answer);
``prefill_cached_share``, from the counters of the engines that prefill (whole engines,
or the prefill engines under PD) read at the end of the run, is the share of the prompt
tokens they found cached instead of computing: ``vllm:prefix_cache_hits`` (G1) plus
``vllm:external_prefix_cache_hits`` (the host tier's, as vLLM counts a connector's) over
``vllm:prefix_cache_queries``. Likewise ``engine_ttft_mean_ms`` is the prefilling
engines' own mean TTFT and ``decode_engine_ttft_mean_ms`` the decode engines' (from the
decode leg's arrival: the KV transfer and the first token; null without PD).
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx
from click.core import ParameterSource

from bench.common import emit, json_option
from bench.kafka_env import bootstrap_option, broker
from bench.peers import HANDOFFS as PEER_HANDOFFS
from bench.peers import POLICIES as PEER_POLICIES
from bench.peers import PeerOptions, launch_peer, peer_versions
from bench.replayers import REPLAYERS, AiperfReplayer, Replayer, SdkReplayer
from kvstream.kafka.topics import ensure_topics
from kvstream.settings import Settings, TopicSettings
from kvstream.tools import fleet
from kvstream.tools.plotting import pyplot
from kvstream.tools.procs import ManagedProcess
from kvstream.tools.simulate.shapes import SHAPES, generate_shape
from kvstream.tools.simulate.trace import Request

ROUTERS = ("kvstream-kv", "kvstream-ttft", "kvstream-ttft-4-replicas", "vllm-router-kv_aware",
           "vllm-router-kv_aware-4-replicas", "vllm-router-cache_aware", "vllm-router-cache_aware-4-replicas",
           "sglang-router-cache_aware", "sglang-router-cache_aware-4-replicas", "round_robin")
TRACES = ("conversation", *SHAPES)
_REPLICAS = "-4-replicas"
_APPROX = "-approx"
_SOCKET = "-socket"
#: The figures of a run whose medians are reported (the rest are the last run's).
_MEDIAN_KEYS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "requests_per_s",
                "cached_token_share", "shed_rate", "failed", "engine_ttft_mean_ms", "router_cpu_s",
                "router_predicted_share", "router_forgone_share", "gateway_ttft_mean_ms", "prefill_cached_share",
                "decode_engine_ttft_mean_ms")
#: The hand-offs kvstream's disaggregated engines can use (``--pd-handoff``).
PD_HANDOFFS = ("nixl", "bootstrap")


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """A router of ``--routers``, by its name."""

    name: str
    #: ``kvstream``, ``sglang-router``, ``vllm-router`` or ``round_robin``.
    kind: str
    policy: str = ""
    replicas: int = 1
    #: kvstream without bridges: the engines given statically, routed by predictions alone.
    approx: bool = False
    #: kvstream's replicas serve sockets the bench holds (systemd socket activation).
    socket: bool = False

    @classmethod
    def parse(cls, name: str) -> RouterSpec:
        if name == "round_robin":
            return cls(name, "round_robin")
        base, replicas = (name[: -len(_REPLICAS)], 4) if name.endswith(_REPLICAS) else (name, 1)
        base, held = (base[: -len(_SOCKET)], True) if base.endswith(_SOCKET) else (base, False)
        base, approx = (base[: -len(_APPROX)], True) if base.endswith(_APPROX) else (base, False)
        if base in ("kvstream-kv", "kvstream-ttft"):
            return cls(name, "kvstream", base.rpartition("-")[2], replicas, approx, held)
        peer, _, policy = base.rpartition("-")
        if not approx and not held and policy in PEER_POLICIES.get(peer, ()):
            return cls(name, peer, policy, replicas)
        raise click.ClickException(
            f"unknown router {name!r}: kvstream-kv or kvstream-ttft (with -approx, -socket), a peer and its policy "
            f"({', '.join(f'{p}-{q}' for p, qs in PEER_POLICIES.items() for q in qs)}) or round_robin, "
            f"each with {_REPLICAS} for four processes"
        )


@dataclass(frozen=True, slots=True)
class Disagg:
    """``--pd P:D``: P prefill engines and D decode engines."""

    prefill: int
    decode: int

    @classmethod
    def parse(cls, text: str) -> Disagg:
        p, _, d = text.partition(":")
        if not (p.isdigit() and d.isdigit() and int(p) >= 1 and int(d) >= 1 and int(p) + int(d) <= 16):
            raise click.ClickException(f"--pd must be P:D, at least one of each and 16 engines at most, got {text!r}")
        return cls(int(p), int(d))


@dataclass
class Front:
    """The router processes a run sends to: ``targets`` in turn; :meth:`restart_one`
    kills the first with SIGKILL and starts it again on its port."""

    targets: list[str]
    procs: list[ManagedProcess]
    restart: Any = None
    #: What a restart took (s): from the kill to serving again.
    restarted: dict[str, float] = field(default_factory=dict)

    def restart_one(self) -> None:
        if self.restart is not None:
            t0 = time.monotonic()
            self.restart()
            self.restarted["down_s"] = round(time.monotonic() - t0, 3)


def _kill(proc: ManagedProcess) -> None:
    os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait()
    proc.stop()


@contextmanager
def front(router: str, engines: list[fleet.Engine], bootstrap: str, work: Path, scale: fleet.Scale) -> Iterator[Front]:
    """The router's processes in front of ``engines``, stopped when the block ends."""
    spec = RouterSpec.parse(router)
    with ExitStack() as stack:
        if spec.kind == "round_robin":
            yield Front([e.url for e in engines], [])
            return
        if spec.kind != "kvstream":
            # Under PD the peer routes the prefill legs by its policy (and kv_aware by the
            # prefill engines' events); on a whole fleet every engine is "prefill".
            prefill = [e for e in engines if e.role != "decode"]
            kv_aware = spec.policy == "kv_aware"
            opts = PeerOptions(spec.kind, spec.policy, tuple(e.url for e in prefill),
                               {e.url: ",".join(e.rank_endpoints()[0]) for e in prefill} if kv_aware else None,
                               fleet.MODEL if kv_aware else None,
                               decode=tuple(e.url for e in engines if e.role == "decode"),
                               bootstrap_ports={e.url: e.bootstrap_port for e in prefill if e.bootstrap_port})
            procs = [launch_peer(opts) for _ in range(spec.replicas)]
            for p in procs:
                stack.callback(lambda p=p: p.stop())
            out = Front([p.url for p in procs], procs)

            def restart_peer() -> None:
                old = out.procs[0]
                _kill(old)
                new = launch_peer(opts, old.port, restart=True)
                stack.callback(new.stop)
                out.procs[0] = new

            out.restart = restart_peer
            yield out
            return
        prefix = f"fleet.{uuid.uuid4().hex[:8]}."
        ensure_topics(Settings(bootstrap=bootstrap, topics=TopicSettings(prefix=prefix)))
        static: tuple[tuple[fleet.Engine, int], ...] = ()
        if spec.approx:
            # What an engine keeps cached: its G1 and the host tier it offloads to.
            static = tuple((e, scale.engine_blocks() + scale.host_blocks()) for e in engines)
        else:
            bridges = [fleet.start_bridge(e, bootstrap, prefix) for e in engines]
            stack.callback(fleet.stop_all, bridges)
        replicas = [fleet.Replica(str(n), bootstrap, prefix, spec.policy, work / f"{prefix}{n}", scale.tokenizer, static,
                                  held=spec.socket) for n in range(spec.replicas)]
        for r in replicas:
            r.start()
            stack.callback(r.stop)
        for r in replicas:
            r.wait_ready(len(engines))
        out = Front([r.url for r in replicas], [r.proc for r in replicas if r.proc is not None])

        def restart_replica() -> None:
            r = replicas[0]
            r.kill()
            r.start(restart=True)
            r.wait_ready(len(engines))
            assert r.proc is not None
            out.procs[0] = r.proc

        out.restart = restart_replica
        yield out


def _trace_requests(trace: str, path: Path | None, count: int, speed: float) -> tuple[list[Request], str]:
    if trace == "conversation":
        return fleet.load_requests(path or fleet.default_trace(), count, speed)
    reqs = generate_shape(trace, count)
    return [Request(r.request_id, r.arrival_ms / speed, r.input_length, r.output_length, r.hash_ids)
            for r in reqs], f"generated: {trace} (kvstream.tools.simulate.shapes, seed 0)"


@click.command("fleet")
@click.option("--engines", "n_engines", default=8, show_default=True, type=click.IntRange(1, 16))
@click.option("--requests", default=400, show_default=True, type=click.IntRange(10))
@click.option("--engine-speed", default=4.0, show_default=True, type=click.FloatRange(min=0.1),
              help="The engines run this many times faster than real time.")
@click.option("--loads", default="1,3", show_default=True,
              help="The trace's rate relative to real time, light to heavy (comma-separated).")
@click.option("--traces", default="conversation", show_default=True,
              help=f"Comma-separated, of: {', '.join(TRACES)} (the generated shapes: kvstream.tools.simulate.shapes).")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1),
              help="Play every run this many times, the routers in turn; report medians and each run.")
@click.option("--restart/--no-restart", default=False, show_default=True,
              help="Also run every router at the heaviest load with one of its processes killed at half and restarted.")
@click.option("--kill-engine/--no-kill-engine", default=True, show_default=True,
              help="Also run kvstream-kv at the heaviest load with engine 1 killed mid-run.")
@click.option("--routers", default=",".join(ROUTERS), show_default=True,
              help="Comma-separated router names (the module's help lists the forms: -4-replicas, -approx, -socket).")
@click.option("--trace", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The conversation trace's file (default: the Mooncake trace beside the repository).")
@click.option("--pd", "pd_text", metavar="P:D",
              help="Disaggregated: P prefill and D decode engines (instead of --engines), each router beside its "
                   "<router>-whole baseline on P+D whole engines.")
@click.option("--pd-handoff", type=click.Choice(PD_HANDOFFS), default="nixl", show_default=True,
              help="With --pd: how kvstream's prefill engines hand the KV to its decode engines (the peers use "
                   "their own: vllm-router nixl, sglang-router bootstrap).")
@click.option("--dp", "dp_ranks", type=click.IntRange(1, 8), default=1, show_default=True,
              help="DP ranks per engine process (--engines ÷ this processes), each router beside its "
                   "<router>-single-rank baseline on --engines single-rank engines.")
@click.option("--quick", is_flag=True,
              help="2 engines (or --pd's), 120 requests, the first load only, no engine killed (for tests).")
@click.option("--replayer", "replayer_name", type=click.Choice(sorted(REPLAYERS)), default="aiperf", show_default=True,
              help="aiperf: the third-party replayer (installed on first use into a cached venv); "
                   "sdk: kvstream's own openai-SDK replayer.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="Also draw TTFT p50/p99 and cached-token share per router and load into this PNG (needs the plot extra: matplotlib).")
@bootstrap_option
@json_option
def fleet_bench(n_engines: int, requests: int, engine_speed: float, loads: str, traces: str, repeats: int,
                restart: bool, kill_engine: bool, routers: str, trace: Path | None, pd_text: str | None,
                pd_handoff: str, dp_ranks: int, quick: bool, replayer_name: str, plot: Path | None, bootstrap: str | None,
                as_json: bool) -> None:
    """Routers head to head in front of the same emulated fleet and traces."""
    if plot is not None:
        pyplot()  # before the runs: a missing extra is said at once
    chosen = [r.strip() for r in routers.split(",") if r.strip()]
    for name in chosen:
        RouterSpec.parse(name)
    shapes = [t.strip() for t in traces.split(",") if t.strip()]
    unknown = sorted(set(shapes) - set(TRACES))
    if unknown or not shapes:
        raise click.ClickException(f"unknown traces {unknown}; known: {', '.join(TRACES)}")
    try:
        factors = [float(s) for s in loads.split(",")]
    except ValueError:
        raise click.ClickException(f"--loads must be numbers separated by commas, got {loads!r}") from None
    if not factors or min(factors) <= 0:
        raise click.ClickException(f"--loads must be positive numbers, got {loads!r}")
    pd = Disagg.parse(pd_text) if pd_text is not None else None
    if pd is not None:
        if click.get_current_context().get_parameter_source("n_engines") is ParameterSource.COMMANDLINE:
            raise click.ClickException("--pd P:D sets the fleet's size: leave --engines out")
        n_engines = pd.prefill + pd.decode
    if quick:
        n_engines, requests, factors, kill_engine = n_engines if pd else min(n_engines, 2 * dp_ranks), 120, factors[:1], False
    if dp_ranks > 1 and (pd is not None or n_engines % dp_ranks or any(RouterSpec.parse(r).approx for r in chosen)):
        raise click.ClickException(f"--dp {dp_ranks} needs --engines a multiple of it, and neither --pd nor -approx")
    scale = fleet.Scale(tokenizer=fleet.local_tokenizer())
    replayer: Replayer = AiperfReplayer() if replayer_name == "aiperf" else SdkReplayer(text=True)
    out: dict[str, Any] = {"engines": n_engines, "requests": requests, "engine_speed": engine_speed, "loads": factors,
                           "repeats": repeats, "peers": peer_versions(), "scale": scale.factor,
                           "tokens_per_id": scale.tokens_per_id,
                           "replayer": {"name": replayer_name, "version": replayer.version}, "traces": {}}
    heavy = max(factors)
    if pd is not None:
        skipped = [r for r in chosen if RouterSpec.parse(r).kind == "round_robin"]
        chosen = [r for r in chosen if r not in skipped]
        out["pd"] = {"prefill": pd.prefill, "decode": pd.decode,
                     "handoff": {"kvstream": pd_handoff, **PEER_HANDOFFS},
                     "baseline": f"<router>-whole: the same router in front of {n_engines} whole engines"}
        if skipped:
            out["skipped"] = {r: "no PD mode: nothing pairs a prefill leg with a decode leg" for r in skipped}
    if dp_ranks > 1:
        out["dp"] = {"ranks": dp_ranks, "engines": n_engines // dp_ranks,
                     "baseline": f"<router>-single-rank: the same router in front of {n_engines} single-rank engines"}
    # Under --pd (--dp) each router's baseline, on whole (single-rank) engines, plays in its turn beside it.
    fleets = ("", "whole") if pd is not None else ("", "single-rank") if dp_ranks > 1 else ("",)
    plays = [(r, load, f) for load in factors for r in chosen for f in fleets]
    if restart:  # round-robin has no process to kill
        plays += [(r, heavy, "restarted") for r in chosen if RouterSpec.parse(r).kind != "round_robin"]
    if kill_engine:
        plays.append(("kvstream-kv", heavy, "engine-killed"))
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    with broker(bootstrap) as servers, tempfile.TemporaryDirectory(prefix="kvstream-bench-fleet-") as tmp:
        n = 0
        for rep in range(repeats):
            for shape in shapes:
                for router, load, scenario in plays:
                    reqs, source = _trace_requests(shape, trace, requests, engine_speed * load)
                    out["traces"].setdefault(shape, {"source": source, "routers": {}})
                    work = Path(tmp) / str(n)
                    work.mkdir()
                    n += 1
                    handoff = _handoff(router, pd_handoff) if pd is not None and scenario != "whole" else None
                    ranks = 1 if scenario == "single-rank" else dp_ranks
                    row = _run(router, reqs, scale, engine_speed, n_engines // ranks, servers, work, scenario, replayer,
                               pd.prefill if handoff else 0, handoff, ranks)
                    name = router + (f"-{scenario}" if scenario else "")
                    runs.setdefault((shape, name, f"{load:g}x"), []).append(row)
                    click.echo(f"[{rep + 1}/{repeats}] {shape} {name} load {load:g}x: "
                               f"{ {k: row.get(k) for k in _MEDIAN_KEYS} }", err=True)
    for (shape, name, load), rows in runs.items():
        out["traces"][shape]["routers"].setdefault(name, {})[load] = _median_row(rows)
    if plot is not None:
        draw(out, plot)
    emit(out, as_json)


def _handoff(router: str, pd_handoff: str) -> str:
    """The hand-off of ``router``'s disaggregated engines: each peer's own, kvstream's
    chosen one."""
    kind = RouterSpec.parse(router).kind
    return pd_handoff if kind == "kvstream" else PEER_HANDOFFS[kind]


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The last run's row with each figure of ``_MEDIAN_KEYS`` (and of its halves)
    replaced by the median over the runs, and every run's row under ``runs``."""
    def med(values: list[Any]) -> Any:
        nums = [v for v in values if isinstance(v, int | float)]
        return round(statistics.median(nums), 4) if nums else None

    out = dict(rows[-1])
    for k in _MEDIAN_KEYS:
        out[k] = med([r.get(k) for r in rows])
    out["halves"] = {
        half: {k: med([r["halves"][half].get(k) for r in rows]) for k in rows[-1]["halves"][half]}
        for half in rows[-1]["halves"]
    }
    if len(rows) > 1:
        out["runs"] = rows
    return out


def _halves(outcomes: Sequence[fleet.Outcome]) -> dict[str, dict[str, Any]]:
    """The first and the second half of the requests' own figures."""
    half = len(outcomes) // 2
    out = {}
    for name, part in (("first", outcomes[:half]), ("second", outcomes[half:])):
        s = fleet.summarize(part, 0.0)
        out[name] = {"requests": s.requests, "failed": s.failed, "ttft_p50_ms": _r(s.ttft_p50_ms),
                     "ttft_p99_ms": _r(s.ttft_p99_ms), "cached_token_share": _r(s.cached_token_share)}
    return out


def _r(v: float) -> float | None:
    return None if v != v else round(v, 4)


def draw(out: dict[str, Any], path: Path) -> None:
    """Per trace, three panels per load: TTFT p50, TTFT p99, cached-token share, one bar
    per router."""
    plt = pyplot()
    import numpy as np

    traces = list(out["traces"])
    fig, grid = plt.subplots(len(traces), 3, figsize=(15, 4.5 * len(traces)), squeeze=False)
    for row, trace in zip(grid, traces, strict=True):
        rows = out["traces"][trace]["routers"]
        routers = list(rows)
        loads = sorted({load for r in rows.values() for load in r}, key=lambda k: float(k[:-1]))
        width = 0.8 / max(len(routers), 1)
        for ax, key, label in zip(row, ("ttft_p50_ms", "ttft_p99_ms", "cached_token_share"),
                                  ("TTFT p50 (ms, wall clock)", "TTFT p99 (ms, wall clock)", "cached-token share"),
                                  strict=True):
            for j, router in enumerate(routers):
                values = [rows[router].get(load, {}).get(key) for load in loads]
                ax.bar(np.arange(len(loads)) + j * width, [np.nan if v is None else v for v in values], width,
                       label=router)
            ax.set_xticks(np.arange(len(loads)) + width * (len(routers) - 1) / 2, [f"load {k}" for k in loads])
            ax.set_title(f"{trace}: {label}")
        row[0].legend(fontsize=6)
    fig.suptitle(f"{out['engines']} emulated engines at {out['engine_speed']:g}x, {out['requests']} requests per trace, "
                 f"replayed by {out['replayer']['name']} {out['replayer']['version']}, medians of {out['repeats']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _run(router: str, reqs: list[Request], scale: fleet.Scale, speed: float, n_engines: int, bootstrap: str,
         work: Path, scenario: str, replayer: Replayer, prefill: int = 0, handoff: str | None = None,
         ranks: int = 1) -> dict[str, Any]:
    """One router at one load on fresh engines of ``ranks`` DP ranks each (with
    ``handoff``: ``prefill`` prefill engines, the rest decode engines): the replay's
    summary, its halves, the routers' CPU, the engines' own figures."""
    engines = fleet.start_engines(n_engines, scale, speed, prefill=prefill, handoff=handoff, ranks=ranks)
    try:
        with front(router, engines, bootstrap, work, scale) as fr, ExitStack() as stack:
            if scenario == "engine-killed":
                stack.enter_context(_at_half(engines, len(reqs), lambda: os.killpg(engines[0].proc.popen.pid, signal.SIGKILL)))
            elif scenario == "restarted":
                stack.enter_context(_at_half(engines, len(reqs), fr.restart_one))
            cpu0 = sum(p.cpu_seconds() for p in fr.procs)
            s, extra, outcomes = replayer.replay(reqs, scale, fr.targets, work / "replay")
            cpu = sum(p.cpu_seconds() for p in fr.procs) - cpu0
            gateway = _gateway_figures(fr.targets) if router.startswith("kvstream") else {}
        engine = _engine_figures(engines[1:] if scenario == "engine-killed" else engines)
    finally:
        fleet.stop_all([e.proc for e in engines])
    row = s.as_dict() | extra | gateway | engine | {
        "shed_rate": round(s.failed / s.requests, 4) if s.requests else None, "halves": _halves(outcomes),
        "router_cpu_s": round(cpu, 2), "loadavg": fleet.loadavg()}
    if fr.restarted:
        row["restart"] = fr.restarted
    return row


#: kvstream's gateway counters the bench reads from each replica (summed).
_GATEWAY = ("kvstream_gateway_prompt_tokens_total", "kvstream_gateway_predicted_cached_tokens_total",
            "kvstream_gateway_forgone_cached_tokens_total", "kvstream_gateway_ttft_seconds_sum",
            "kvstream_gateway_ttft_seconds_count", "kvstream_active_op_lag_seconds_sum",
            "kvstream_active_op_lag_seconds_count")


def _gateway_figures(replicas: Sequence[str]) -> dict[str, Any]:
    """What kvstream's replicas saw of the run: the cached tokens they predicted and the
    ones they gave up for load (credited on another candidate beyond the chosen one's),
    as shares of the prompt tokens, their own mean TTFT (from a request's arrival at the
    gateway: the engine's, the gateway's tokenizing and routing, not the client's), and
    how late they applied their peers' ops (several replicas)."""
    sums = dict.fromkeys(_GATEWAY, 0.0)
    with httpx.Client(timeout=10.0) as client:
        for url in replicas:
            for line in client.get(url + "/metrics").text.splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in sums:
                    sums[name] += float(line.split()[-1])
    prompt = sums[_GATEWAY[0]] or math.nan
    count, ops = sums[_GATEWAY[4]], sums[_GATEWAY[6]]
    return {"router_predicted_share": _r(sums[_GATEWAY[1]] / prompt), "router_forgone_share": _r(sums[_GATEWAY[2]] / prompt),
            "gateway_ttft_mean_ms": round(1000 * sums[_GATEWAY[3]] / count, 2) if count else None,
            "peer_op_lag_mean_ms": round(1000 * sums[_GATEWAY[5]] / ops, 2) if ops else None}


#: The engines' series the bench reads at the end of a run, by a short name.
_ENGINE = {"vllm:time_to_first_token_seconds_sum": "ttft_s", "vllm:time_to_first_token_seconds_count": "firsts",
           "vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits",
           "vllm:external_prefix_cache_hits_total": "host_hits"}


def _engine_figures(engines: list[fleet.Engine]) -> dict[str, Any]:
    """The engines' own figures (the module's notes): the mean TTFT (from arrival) of the
    engines that prefill and of the decode engines, what the replayer's TTFT is beside the
    router's hops and the client's own time; and the prefilling engines' cached share."""
    sums = {leg: dict.fromkeys(_ENGINE.values(), 0.0) for leg in ("prefill", "decode")}
    with httpx.Client(timeout=10.0) as client:
        for e in engines:
            leg = sums["decode" if e.role == "decode" else "prefill"]
            for line in client.get(e.url + "/metrics").text.splitlines():
                name = _ENGINE.get(line.split("{", 1)[0].split(" ", 1)[0])
                if name is not None:
                    leg[name] += float(line.split()[-1])

    def ttft(leg: dict[str, float]) -> float | None:
        return round(1000 * leg["ttft_s"] / leg["firsts"], 2) if leg["firsts"] else None

    p = sums["prefill"]
    return {"engine_ttft_mean_ms": ttft(p), "decode_engine_ttft_mean_ms": ttft(sums["decode"]),
            "prefill_cached_share": _r((p["hits"] + p["host_hits"]) / p["queries"]) if p["queries"] else None}


#: The engines' samples whose sum is the requests they have taken.
_TAKEN = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:request_success_total")


def _taken(client: httpx.Client, url: str) -> float:
    text = client.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(_TAKEN))


@contextmanager
def _at_half(engines: list[fleet.Engine], total: int, act: Any, every_s: float = 0.25) -> Iterator[None]:
    """``act()`` (kill an engine, restart a router) once the engines have taken half of
    the ``total`` requests, by their own counters (so whatever the replayer): the engines
    that prefill, as every request goes to one of them (and, under PD, to a decode engine
    too)."""
    engines = [e for e in engines if e.role != "decode"]
    done = threading.Event()
    failure: list[BaseException] = []

    def watch() -> None:
        with httpx.Client(timeout=2.0) as client:
            while not done.wait(every_s):
                try:
                    taken = sum(_taken(client, e.url) for e in engines)
                except httpx.HTTPError:
                    continue  # an engine busy past the timeout: ask again
                if taken >= total // 2:
                    try:
                        act()
                    except BaseException as exc:  # said after the replay, which must not hang
                        failure.append(exc)
                    return

    thread = threading.Thread(target=watch, name="at-half", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    if failure:
        raise click.ClickException(f"the mid-run action failed: {failure[0]}")
