"""``kvstream worker``: run a worker: an engine's KV events → consolidator → Kafka."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import click

from kvstream.events.errors import RegistrationError
from kvstream.events.registration import Registration, normalize_url
from kvstream.kafka.errors import KafkaConfigError
from kvstream.logs import configure_logging, get_logger, logging_flags
from kvstream.roles import Handoff, Role
from kvstream.settings import Settings, SettingsError, load_settings
from kvstream.worker.announce import WorkerAnnouncer
from kvstream.worker.consolidator import Mode
from kvstream.worker.engine_node import EngineNode, EngineNodeOptions
from kvstream.worker.errors import (
    BridgeStateError,
    EngineBridgeError,
    PublisherError,
    RegistryTopicError,
)
from kvstream.worker.fence import TakeOverWatch, describe
from kvstream.worker.incarnation import Incarnation, live_incarnation
from kvstream.worker.metrics import WorkerCollector, serve_metrics
from kvstream.worker.options import DEFAULTS
from kvstream.worker.publisher import KafkaPublisher, PublisherOptions, QueueFull
from kvstream.worker.zmq_bridge import BridgeOptions, Endpoint, Flavour

log = get_logger(__name__)

ENGINES = ("zmq", "vllm", "sglang", "synthetic")


def _setting(key: str, what: str = "") -> str:
    """A flag's help: what it does, and the [worker] setting it overrides (its bounds
    and default are that setting's, kvstream.worker.options)."""
    default = getattr(DEFAULTS, key)
    shown = "" if default is None else f", default {getattr(default, 'value', default)}"
    return f"{what} [settings: worker.{key}{shown}]".lstrip()


@click.command("worker")
@click.option(
    "--engine",
    type=click.Choice(ENGINES),
    required=True,
    help="Where KV events come from: vllm or sglang (their ZMQ KV events), zmq (either, "
    "detected from the event fields), synthetic (the built-in tiered pool).",
)
@click.option(
    "--endpoint",
    "endpoints",
    multiple=True,
    help="The engine's KV-event PUB endpoint, e.g. tcp://127.0.0.1:5557; repeat it for "
    "each DP rank's publisher (one worker, one epoch, one rank per endpoint).",
)
@click.option(
    "--replay-endpoint",
    "replay_endpoints",
    multiple=True,
    help="The engine's replay (ROUTER) endpoint, to repair gaps and resume after a "
    "restart; none, or one per --endpoint in the same order.",
)
@click.option("--topic", default="", show_default=True, help="The engine's event topic (subscription prefix).")
@click.option(
    "--dp-rank",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Rank of batches that carry none, for the first endpoint (the n-th gets this + n).",
)
@click.option("--block-size", type=click.IntRange(1), help="Router block size (events of another size are skipped). [settings: router.block_size]")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help=_setting("state_dir", "Keep the bridge's state here (RocksDB) to survive its restarts without losing blocks."),
)
@click.option("--checkpoint-s", type=float, help=_setting("checkpoint_s", "With --state-dir: checkpoint period."))
@click.option(
    "--offload-blocks-per-chunk",
    type=int,
    help=_setting("offload_blocks_per_chunk", "vLLM: the offloading connector's blocks_per_chunk, when its KV events "
                  "are not self-describing (each offload event then names a chunk by its last block)."),
)
@click.option(
    "--engine-url",
    help="The engine's OpenAI-compatible base URL (http://host:port, no /v1), registered on "
    "kvstream.workers so that router replicas (the gateway) can send it requests. Without it "
    "the worker is registered but not routable by the gateway (e.g. a synthetic worker).",
)
@click.option(
    "--model", "models", multiple=True,
    help="A model name the engine serves (its served model name); repeat for each. Needed with --engine-url.",
)
@click.option("--lora", "loras", multiple=True, help="A LoRA adapter name the engine serves; repeat for each.")
@click.option(
    "--role", type=click.Choice([r.value for r in Role]),
    help=_setting("role", "What the engine does with a request: all of it, or one leg of a disaggregated one."),
)
@click.option(
    "--handoff", type=click.Choice([h.value for h in Handoff]),
    help=_setting("handoff", "With --role prefill or decode: how the KV goes to the decode engine (nixl: vLLM's "
                  "NixlConnector; bootstrap: SGLang)."),
)
@click.option(
    "--bootstrap-port", type=int,
    help=_setting("bootstrap_port", "With --handoff bootstrap: the prefill engine's --disaggregation-bootstrap-port "
                  "(needed for --role prefill)."),
)
@click.option("--worker-id", required=True, type=click.IntRange(0, (1 << 64) - 1), help="This worker's id (u64).")
@click.option(
    "--take-over", is_flag=True,
    help="Start even if another live process publishes as this --worker-id (it is refused "
    "otherwise): this one replaces it in the routers; stop the other one.",
)
@click.option("--bootstrap", envvar="KVSTREAM_BOOTSTRAP", help="Kafka bootstrap servers (default: the local broker).")
@click.option("--config", type=click.Path(dir_okay=False), help="TOML settings file.")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), help=_setting("mode"))
@click.option("--lease-ms", type=int, help=_setting("lease_ms"))
@click.option("--heartbeat-s", type=float, help=_setting("heartbeat_s"))
@click.option("--linger-ms", type=float, help=_setting("linger_ms"))
@click.option("--queue-full", type=click.Choice([q.value for q in QueueFull]), help=_setting("queue_full"))
@click.option("--metrics-port", type=int, help=_setting("metrics_port", "Prometheus port; 0: none."))
@click.option(
    "--metrics-addr", default="127.0.0.1", show_default=True,
    help="Address the Prometheus endpoint binds (0.0.0.0: every interface).",
)
@click.option("--prompts", default=0, show_default=True, type=click.IntRange(0), help="synthetic: prompts to run; 0: until stopped.")
@click.option("--rate", default=20.0, show_default=True, type=click.FloatRange(0.01), help="synthetic: prompts per second.")
@click.option("--seed", default=0, show_default=True, help="synthetic: workload seed.")
@click.option("--device-blocks", default=512, show_default=True, type=click.IntRange(1), help="synthetic: G1 capacity.")
@click.option("--host-blocks", default=2048, show_default=True, type=click.IntRange(1), help="synthetic: G2 capacity.")
@click.option("--disk-blocks", default=0, show_default=True, type=click.IntRange(0), help="synthetic: G3 capacity; 0: no disk tier.")
@click.option("--disk-dir", type=click.Path(file_okay=False, path_type=Path), help="synthetic: where the G3 block file lives.")
@click.option("--disk-min-seen", type=click.IntRange(1),
              help="synthetic: sightings of a block before it goes on to G3 (default 1; docs/RESULTS.md).")
def worker(
    engine: str,
    endpoints: tuple[str, ...],
    replay_endpoints: tuple[str, ...],
    topic: str,
    dp_rank: int,
    block_size: int | None,
    state_dir: Path | None,
    checkpoint_s: float | None,
    offload_blocks_per_chunk: int | None,
    engine_url: str | None,
    models: tuple[str, ...],
    loras: tuple[str, ...],
    role: str | None,
    handoff: str | None,
    bootstrap_port: int | None,
    worker_id: int,
    take_over: bool,
    bootstrap: str | None,
    config: str | None,
    mode: str | None,
    lease_ms: int | None,
    heartbeat_s: float | None,
    linger_ms: float | None,
    queue_full: str | None,
    metrics_port: int | None,
    metrics_addr: str,
    prompts: int,
    rate: float,
    seed: int,
    device_blocks: int,
    host_blocks: int,
    disk_blocks: int,
    disk_dir: Path | None,
    disk_min_seen: int | None,
) -> None:
    """Run a worker: publish an engine's KV-cache events to Kafka (DESIGN.md §3).

    --engine vllm|sglang|zmq bridges an engine's KV-event publishers (docs/ENGINES.md);
    --engine synthetic runs the built-in tiered block pool (needs torch) on a seeded
    workload with shared prefixes."""
    if engine == "synthetic" and disk_blocks and disk_dir is None:
        raise click.UsageError("--disk-blocks needs --disk-dir")
    if engine != "synthetic" and not endpoints:
        raise click.UsageError(f"--engine {engine} needs --endpoint (the engine's KV-event PUB address)")
    if engine_url is not None and not models:
        raise click.UsageError("--engine-url needs at least one --model (the names the gateway routes by)")
    if replay_endpoints and len(replay_endpoints) != len(endpoints):
        raise click.UsageError(
            f"{len(replay_endpoints)} --replay-endpoint for {len(endpoints)} --endpoint: give one per endpoint, or none"
        )
    flags = {
        "mode": mode,
        "lease_ms": lease_ms,
        "heartbeat_s": heartbeat_s,
        "linger_ms": linger_ms,
        "queue_full": queue_full,
        "metrics_port": metrics_port,
        "state_dir": state_dir,
        "checkpoint_s": checkpoint_s,
        "offload_blocks_per_chunk": offload_blocks_per_chunk,
        "role": role,
        "handoff": handoff,
        "bootstrap_port": bootstrap_port,
    }
    try:
        # Flags over KVSTREAM_WORKER__* over the TOML file's [worker] section.
        settings = load_settings(
            config, bootstrap=bootstrap, worker={k: v for k, v in flags.items() if v is not None}, **logging_flags()
        )
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None
    configure_logging(settings.log_level, settings.log_format)
    ws = settings.worker
    serves = Serves(engine_url, models, loras, Role(ws.role), None if ws.handoff is None else Handoff(ws.handoff),
                    ws.bootstrap_port)
    try:
        if engine_url is not None:
            normalize_url(engine_url)
        # Checked here so that a bad name or role fails before anything starts.
        serves.registration(worker_id, 1, (0,), engine, None, 0, 0)
    except RegistrationError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        options = PublisherOptions(
            worker_id=worker_id,
            lease_ms=ws.lease_ms,
            heartbeat_s=ws.heartbeat_s,
            linger_ms=ws.linger_ms,
            queue_full=ws.queue_full,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    bridge_options: BridgeOptions | None = None
    if engine != "synthetic":
        try:
            bridge_options = BridgeOptions(
                endpoints=tuple(
                    Endpoint(ep, replay_endpoints[i] if replay_endpoints else None, dp_rank + i)
                    for i, ep in enumerate(endpoints)
                ),
                topic=topic.encode(),
                flavour=Flavour.AUTO if engine == "zmq" else Flavour(engine),
                block_size=block_size or settings.router.block_size,
                offload_blocks_per_chunk=ws.offload_blocks_per_chunk,
            )
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    _check_worker_id(settings, worker_id, take_over)
    stop = threading.Event()
    interrupted = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: (interrupted.set(), stop.set()))
    if bridge_options is None:
        _run_synthetic(
            settings, options, ws.mode, stop, metrics_addr,
            SyntheticRun(prompts, rate, seed, device_blocks, host_blocks, disk_blocks, disk_dir, disk_min_seen),
            serves,
        )
    else:
        _run_engine(settings, options, bridge_options, stop, metrics_addr, serves, engine)
    if interrupted.is_set():
        # After the clean stop, Ctrl-C ends the command as every kvstream command does (130).
        raise KeyboardInterrupt


def _run_engine(
    settings: Settings,
    options: PublisherOptions,
    bridge_options: BridgeOptions,
    stop: threading.Event,
    metrics_addr: str,
    serves: Serves,
    engine: str,
) -> None:
    ws = settings.worker
    node_options = EngineNodeOptions(
        options, bridge_options, ws.mode, ws.state_dir, ws.checkpoint_s
    )
    try:
        node = EngineNode(settings, node_options)
    except (PublisherError, KafkaConfigError, BridgeStateError) as exc:
        raise click.ClickException(f"cannot start the worker: {exc}") from None
    left = 0
    clean = False
    registered: Registered | None = None
    try:
        node.start()
        registered = _announce(
            settings, serves, node.publisher, bridge_options.block_size,
            tuple(e.default_dp_rank for e in bridge_options.endpoints), engine, None, stop,
        )
        if ws.metrics_port:
            serve_metrics(ws.metrics_port, WorkerCollector(node.publisher, node.consolidator, node.bridge), metrics_addr)
        log.info(
            "worker_started", worker_id=options.worker_id, epoch=node.publisher.epoch,
            endpoints=[e.endpoint for e in bridge_options.endpoints], engine=engine, mode=ws.mode.value,
        )
        node.run(stop)
        clean = registered.successor is None
    except (PublisherError, EngineBridgeError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        _withdraw(registered)
        left = node.close(withdraw=clean)
        log.info(
            "worker_stopped", worker_id=options.worker_id, batches=node.publisher.stats.batches, undelivered=left,
            withdrawn=clean and ws.state_dir is None,
        )
    _taken_over(options.worker_id, registered)
    if left:
        raise click.ClickException(f"{left} batches were not acknowledged by Kafka before shutdown")


def _check_worker_id(settings: Settings, worker_id: int, take_over: bool) -> None:
    """Refuse to start beside a live process with this worker id, unless told to take over."""
    def waiting(last: Incarnation, wait_s: float) -> None:
        log.info("worker_id_recently_used", detail=last.describe(), waiting_s=round(wait_s, 1))

    try:
        other = live_incarnation(settings, worker_id, waiting)
    except (RegistryTopicError, KafkaConfigError) as exc:
        raise click.ClickException(f"cannot start the worker: {exc}") from None
    if other is None:
        return
    if take_over:
        log.warning("worker_taking_over", detail=other.describe())
        return
    raise click.ClickException(
        f"another process publishes as {other.describe()}; stop it, give this one another --worker-id, "
        "or pass --take-over to replace it"
    )


@dataclass(frozen=True, slots=True)
class Serves:
    """What the worker registers for the gateway (kvstream.events.registration)."""

    engine_url: str | None
    models: tuple[str, ...]
    loras: tuple[str, ...]
    role: Role
    handoff: Handoff | None
    bootstrap_port: int | None

    def registration(
        self, worker_id: int, block_size: int, dp_ranks: tuple[int, ...], engine: str, kv_capacity_blocks: int | None,
        epoch: int, registered_at_ms: int,
    ) -> Registration:
        return Registration(
            worker_id, self.engine_url, self.models, self.loras, block_size, dp_ranks, engine, kv_capacity_blocks,
            epoch, registered_at_ms, role=self.role, handoff=self.handoff, bootstrap_port=self.bootstrap_port,
        )


@dataclass(frozen=True, slots=True)
class Registered:
    """The worker's registration and the watch that stops it when another process
    takes its id over (kvstream.worker.fence)."""

    announcer: WorkerAnnouncer
    watch: TakeOverWatch

    @property
    def successor(self) -> Registration | None:
        return self.watch.successor


def _announce(
    settings: Settings, serves: Serves, publisher: KafkaPublisher, block_size: int,
    dp_ranks: tuple[int, ...], engine: str, kv_capacity_blocks: int | None, stop: threading.Event,
) -> Registered:
    """Register the worker under its publisher's first epoch (its incarnation), and
    watch for a successor: ``stop`` is set when one registers."""
    reg = serves.registration(
        publisher.worker_id, block_size, dp_ranks, engine, kv_capacity_blocks, publisher.epoch, int(time.time() * 1000)
    )
    watch = TakeOverWatch(settings, reg.worker_id, lambda _successor: stop.set())
    announcer = WorkerAnnouncer(settings, reg)
    try:
        announcer.announce()
    except BaseException:
        announcer.close()
        watch.close()
        raise
    watch.start(reg)
    return Registered(announcer, watch)


def _withdraw(registered: Registered | None) -> None:
    """The tombstone, on the way out, unless a successor registered; a failure is logged,
    never masks why we stop."""
    if registered is None:
        return
    registered.watch.close()
    announcer = registered.announcer
    try:
        if registered.successor is None:
            announcer.withdraw()
    except PublisherError as exc:
        log.error("worker_unregister_failed", worker_id=announcer.registration.worker_id, error=str(exc))
    finally:
        announcer.close()


def _taken_over(worker_id: int, registered: Registered | None) -> None:
    """Fail the command when a successor stopped this worker."""
    if registered is not None and (successor := registered.successor) is not None:
        raise click.ClickException(
            f"worker {worker_id} was taken over by another process ({describe(successor)}); this one stopped "
            "without withdrawing its blocks or its registration"
        )


@dataclass(frozen=True, slots=True)
class SyntheticRun:
    prompts: int
    rate: float
    seed: int
    device_blocks: int
    host_blocks: int
    disk_blocks: int
    disk_dir: Path | None
    #: None: the offload engine's default.
    disk_min_seen: int | None


def _run_synthetic(
    settings: Settings,
    options: PublisherOptions,
    mode: Mode,
    stop: threading.Event,
    metrics_addr: str,
    run: SyntheticRun,
    serves: Serves,
) -> None:
    # torch is imported only here: a zmq worker (and any router host) runs without it.
    from kvstream.worker.node import SyntheticNode, SyntheticNodeOptions
    from kvstream.worker.synthetic import PromptSetOptions, shared_prefix_prompts

    node_options = SyntheticNodeOptions(
        options, mode, device_blocks=run.device_blocks, host_blocks=run.host_blocks,
        disk_blocks=run.disk_blocks or None, disk_dir=run.disk_dir,
        **({} if run.disk_min_seen is None else {"disk_min_seen": run.disk_min_seen}),
    )
    try:
        node = SyntheticNode(settings, node_options)
    except (PublisherError, KafkaConfigError, ValueError) as exc:
        raise click.ClickException(f"cannot start the synthetic worker: {exc}") from None
    try:
        registered = _announce(
            settings, serves, node.publisher, node_options.layout.block_size, (0,), "synthetic", run.device_blocks,
            stop,
        )
    except PublisherError as exc:
        node.close()
        raise click.ClickException(f"cannot start the synthetic worker: {exc}") from None
    ws = settings.worker
    if ws.metrics_port:
        serve_metrics(ws.metrics_port, WorkerCollector(node.publisher, node.consolidator), metrics_addr)
    log.info("worker_started", worker_id=options.worker_id, epoch=node.publisher.epoch, engine="synthetic", mode=mode.value)
    workload = shared_prefix_prompts(PromptSetOptions(prompts=run.prompts or 1 << 62, seed=run.seed))
    period = 1.0 / run.rate
    next_at = time.monotonic()
    done = 0
    clean = False
    try:
        for tokens in workload:
            if stop.is_set():
                break
            node.run_prompt(tokens)
            done += 1
            next_at += period
            while not stop.is_set() and (wait := next_at - time.monotonic()) > 0:
                node.poll()
                stop.wait(min(wait, node.publisher.due_in()))
        clean = registered.successor is None
    except PublisherError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        _withdraw(registered)
        left = node.close(withdraw=clean)
        log.info("worker_stopped", worker_id=options.worker_id, prompts=done, undelivered=left, withdrawn=clean)
    _taken_over(options.worker_id, registered)
    if left:
        raise click.ClickException(f"{left} batches were not acknowledged by Kafka before shutdown")
