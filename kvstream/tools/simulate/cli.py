"""``kvstream simulate``: trace-driven fleet simulation (DESIGN.md §11).

Without ``--bootstrap`` the events go through an in-memory log folded like a replica
folds Kafka; with it, through the real broker into one or more replicas.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import fields
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import click

from kvstream.engine_model.costs import CostModel
from kvstream.logs import configure_logging, current_logging
from kvstream.router import RouterConfig, SchedulerConfig
from kvstream.router.errors import SchedulerConfigError
from kvstream.router.policy import RATE_SCOPES
from kvstream.settings import SettingsError, load_settings
from kvstream.tools.output import emit
from kvstream.tools.plotting import pyplot
from kvstream.tools.simulate.engine import EngineConfig
from kvstream.tools.simulate.errors import SimulationError
from kvstream.tools.simulate.eventlog import EventLog, KafkaEventLog, MemoryEventLog
from kvstream.tools.simulate.policies import POLICIES
from kvstream.tools.simulate.reference import lru_reference
from kvstream.tools.simulate.report import plot, summarize
from kvstream.tools.simulate.runner import LogFactory, SimClock, SimOptions
from kvstream.tools.simulate.runner import simulate as run_simulation
from kvstream.tools.simulate.sweep import (
    SweepPoint,
    describe_window,
    offered_rate,
    parse_sweep,
    plot_sweep,
    saturation,
    saturation_markdown,
    scaled,
)
from kvstream.tools.simulate.trace import MOONCAKE_TOKENS_PER_ID, Request, TraceOptions, read_mooncake
from kvstream.tools.simulate.workload import WorkloadOptions, generate
from kvstream.worker.consolidator import Mode

_ENGINE = EngineConfig()


def _dataclass_options(cls: type, prefix: str, skip: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """One flag per field of ``cls`` (same name, its default), so that every weight and
    cost of the library can be set from the command line."""
    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        for field in reversed(fields(cls)):
            if field.name in skip:
                continue
            default = field.default
            kind = int if str(field.type).startswith("int") else float
            f = click.option(f"--{field.name.replace('_', '-')}", field.name, type=kind, default=default,
                             show_default=True, help=f"{prefix}{field.name} (see docs/RESULTS.md).")(f)
        return f
    return decorate


@click.command("simulate")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Mooncake JSONL trace (default: a generated workload with shared prefixes).")
@click.option("--tokens-per-id", type=click.IntRange(min=1), default=MOONCAKE_TOKENS_PER_ID, show_default=True,
              help="Prompt tokens each hash id of --trace stands for (Mooncake: 512; Alibaba's Qwen traces: 16).")
@click.option("--speed", type=float, default=1.0, show_default=True,
              help="Replay speed (arrival times ÷ speed); --sweep replaces it.")
@click.option("--limit", type=click.IntRange(min=1), help="Use only the first N requests.")
@click.option("--sessions", type=click.IntRange(min=1), default=40, show_default=True,
              help="Sessions of the generated workload (without --trace).")
@click.option("--workers", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--policy", "policies", type=click.Choice(list(POLICIES) + ["all"]), multiple=True, default=["kv"],
              show_default=True, help="Routing policy; repeat it, or 'all', to compare.")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default=Mode.DEDUP.value, show_default=True,
              help="Consolidator mode of the workers.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--block-size", type=click.IntRange(min=1), default=_ENGINE.block_size, show_default=True,
              help="Tokens per KV block (engine and router).")
@click.option("--device-tokens", type=click.IntRange(min=1), default=_ENGINE.device_blocks * _ENGINE.block_size,
              show_default=True, help="G1 capacity per worker, in tokens.")
@click.option("--host-tokens", type=click.IntRange(min=1), default=_ENGINE.host_blocks * _ENGINE.block_size,
              show_default=True, help="G2 capacity per worker, in tokens.")
@click.option("--disk-tokens", type=click.IntRange(min=0), default=_ENGINE.disk_blocks * _ENGINE.block_size,
              show_default=True, help="G3 capacity per worker, in tokens (0: no disk tier).")
@click.option("--disk-min-seen", type=click.IntRange(min=1), default=_ENGINE.disk_min_seen, show_default=True,
              help="Sightings of a block (G1 registrations, hits, onboards) before it goes on to G3.")
@_dataclass_options(CostModel, "cost: ")
@_dataclass_options(SchedulerConfig, "router: ", skip=("allowed_workers", "policy", "ttft_rate_scope"))
@click.option("--ttft-rate-scope", "ttft_rate_scope", type=click.Choice(RATE_SCOPES),
              default=SchedulerConfig().ttft_rate_scope, show_default=True,
              help="router: the ttft policy prices every worker at the fleet's learned throughput, or each at its own.")
@click.option("--window", type=click.IntRange(min=1), default=3000, show_default=True,
              help="Requests per window of the per-window hit rates (`windows` in the JSON).")
@click.option("--sweep", "sweep_spec", help="Load sweep, e.g. 'speed=1,2,4,8': every policy at every speed; "
              "--plot then draws TTFT p50/p99 and hit rate against load.")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs (policies × speeds) at once, in separate processes (in-memory log only).")
@click.option("--bootstrap", help="Kafka bootstrap servers: send the events through the real broker.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML settings file (with --bootstrap).")
@click.option("--topic-prefix", help="Topic name prefix (with --bootstrap).")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="Replicas folding the events (with --bootstrap); all must agree.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write TTFT CDFs and hit rates per policy to this PNG (needs the plot extra: matplotlib).")
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr (default: when it is a terminal).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def simulate(
    trace_path: Path | None, tokens_per_id: int, speed: float, limit: int | None, sessions: int, workers: int,
    policies: tuple[str, ...], mode: str, seed: int, block_size: int, device_tokens: int, host_tokens: int,
    disk_tokens: int, disk_min_seen: int, window: int, sweep_spec: str | None, jobs: int, bootstrap: str | None, config_file: str | None,
    topic_prefix: str | None, replicas: int, plot_path: Path | None, progress: bool | None, as_json: bool,
    **weights: Any,
) -> None:
    """Trace-driven fleet simulation: routing policies over simulated tiered workers."""
    if plot_path is not None:
        pyplot()  # before the runs: a missing extra is said at once
    try:
        speeds = parse_sweep(sweep_spec) if sweep_spec is not None else [speed]
        cost = CostModel(**{f.name: weights.pop(f.name) for f in fields(CostModel)})
        scheduler = SchedulerConfig(**weights)
        engine = EngineConfig(
            device_blocks=device_tokens // block_size,
            host_blocks=host_tokens // block_size,
            disk_blocks=disk_tokens // block_size,
            block_size=block_size,
            disk_min_seen=disk_min_seen,
            cost=cost,
        )
        make_log = _log_factory(bootstrap, config_file, topic_prefix, replicas)
        names = list(POLICIES) if "all" in policies else list(dict.fromkeys(policies))
        show = sys.stderr.isatty() if progress is None else progress
        base = _requests(trace_path, limit, sessions, seed, tokens_per_id)
        references = {
            # One LRU cache of the fleet's whole capacity, and of its host (G2) capacity.
            "upper_bound": lru_reference(base, block_size, workers * (engine.device_blocks + engine.host_blocks
                                                                      + engine.disk_blocks)),
            "host_lru": lru_reference(base, block_size, workers * engine.host_blocks),
        }
        if jobs > 1 and bootstrap is not None:
            raise SimulationError("--jobs runs the in-memory log only (drop --bootstrap, or --jobs)")
        runs = [
            (sp, scaled(base, sp), SimOptions(workers=workers, policy=name, mode=Mode(mode), seed=seed,
                                              engine=engine, scheduler=scheduler))
            for sp in speeds
            for name in names
        ]
        if jobs > 1:
            # Each run is independent and deterministic: separate processes give the same results.
            # Spawned, not forked: a fork copies the caller's threads' state (Kafka clients,
            # torch), and a forked run crashed in its garbage collector.
            with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"),
                                     initializer=configure_logging, initargs=current_logging()) as pool:
                futures = [pool.submit(run_simulation, reqs, opts, memory_log) for _, reqs, opts in runs]
                results = [f.result() for f in futures]
        else:
            results = [run_simulation(reqs, opts, make_log, progress=show) for _, reqs, opts in runs]
        points = [SweepPoint(sp, offered_rate(reqs), r) for (sp, reqs, _), r in zip(runs, results)]
        if plot_path is not None:
            title = f"{_source(trace_path, sessions, seed)}: {describe_window(base, limit)}"
            if sweep_spec is not None:
                plot_sweep(points, references, plot_path, title)
            else:
                plot([p.result for p in points], plot_path)
    except (SimulationError, SettingsError, SchedulerConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    summaries = [
        {**summarize(p.result, window, references), "speed": p.speed, "offered_req_per_s": round(p.offered, 3)}
        for p in points
    ]
    common = {"trace": _source(trace_path, sessions, seed), "block_size": block_size,
              "event_log": "kafka" if bootstrap else "memory"}
    if sweep_spec is not None:
        table = saturation(summaries)
        if as_json:
            click.echo(json.dumps({**common, "sweep": summaries, "saturation": table}))
        else:
            click.echo(saturation_markdown(table, summaries))
        return
    common["speed"] = speed
    if len(summaries) == 1:
        emit({**summaries[0], **common}, as_json)
    elif as_json:
        click.echo(json.dumps({**common, "runs": summaries}))
    else:
        for s in summaries:
            emit({**s, **common}, False)
            click.echo()


def _source(trace_path: Path | None, sessions: int, seed: int) -> str:
    return str(trace_path) if trace_path is not None else f"generated(sessions={sessions}, seed={seed})"


def _requests(
    trace_path: Path | None, limit: int | None, sessions: int, seed: int, tokens_per_id: int
) -> list[Request]:
    """The workload at speed 1 (``scaled`` replays it faster)."""
    options = TraceOptions(limit=limit, tokens_per_id=tokens_per_id)  # validates them
    if trace_path is not None:
        return read_mooncake(trace_path, options)
    reqs = generate(WorkloadOptions(seed=seed, sessions=sessions))
    return reqs[:limit] if limit is not None else reqs


def memory_log(config: RouterConfig, clock: SimClock, seed: int) -> EventLog:
    """The in-memory event log (a module-level function: --jobs sends it to other processes)."""
    return MemoryEventLog(config, clock, seed)


def _log_factory(bootstrap: str | None, config_file: str | None, topic_prefix: str | None, replicas: int) -> LogFactory:
    if bootstrap is None:
        if replicas != 1 or topic_prefix or config_file:
            raise SimulationError("--replicas, --topic-prefix and --config need --bootstrap (a real broker)")
        return memory_log
    settings = load_settings(config_file, bootstrap=bootstrap)
    if topic_prefix is not None:
        settings.topics = settings.topics.model_copy(update={"prefix": topic_prefix})

    def kafka(config: RouterConfig, clock: SimClock, seed: int) -> EventLog:
        return KafkaEventLog(settings, config, clock, seed, replicas=replicas)

    return kafka

