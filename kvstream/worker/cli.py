"""``kvstream worker``: run a worker: an engine's KV events → consolidator → Kafka."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import click

from kvstream.kafka.errors import KafkaConfigError
from kvstream.logs import get_logger
from kvstream.settings import Settings, SettingsError, load_settings
from kvstream.worker.consolidator import Consolidator, Mode
from kvstream.worker.errors import EngineBridgeError, PublisherError
from kvstream.worker.metrics import WorkerCollector, serve_metrics
from kvstream.worker.publisher import KafkaPublisher, PublisherOptions, QueueFull
from kvstream.worker.zmq_bridge import BridgeOptions, ZmqEngineBridge

log = get_logger(__name__)

#: How often the loop reports what it did (a worker runs for ever: this is its progress).
STATUS_EVERY_S = 30.0


def run_zmq_worker(
    publisher: KafkaPublisher,
    consolidator: Consolidator,
    bridge: ZmqEngineBridge,
    stop: threading.Event,
) -> None:
    """The worker loop: engine messages in, housekeeping, until ``stop`` is set."""
    # Wake at least this often for the publisher's linger and heartbeat timers.
    wake_ms = max(1, int(min(publisher.options.linger_ms, publisher.options.heartbeat_s * 1000)))
    next_status = time.monotonic() + STATUS_EVERY_S
    while not stop.is_set():
        bridge.poll(wake_ms, max_messages=256)
        publisher.poll(consolidator)
        if time.monotonic() >= next_status:
            next_status += STATUS_EVERY_S
            s = publisher.stats
            log.info(
                "worker_status",
                engine_messages=bridge.stats.messages,
                blocks_held=consolidator.block_count(),
                batches=s.batches,
                acked_blocks=s.acked_blocks,
                delivery_failures=s.delivery_failures,
                queue_depth=publisher.queue_depth,
                engine_issues=sum(bridge.issues.values()),
                anomalies=sum(consolidator.anomalies.values()),
            )


@click.command("worker")
@click.option("--engine", type=click.Choice(["zmq", "synthetic"]), required=True, help="Where KV events come from.")
@click.option("--endpoint", help="zmq: the engine's KV-event PUB endpoint, e.g. tcp://127.0.0.1:5557.")
@click.option("--replay-endpoint", help="zmq: the engine's replay (ROUTER) endpoint, to repair gaps.")
@click.option("--topic", default="", show_default=True, help="zmq: the engine's event topic (subscription prefix).")
@click.option("--dp-rank", default=0, show_default=True, type=click.IntRange(0), help="zmq: rank of batches that carry none.")
@click.option("--worker-id", required=True, type=click.IntRange(0, (1 << 64) - 1), help="This worker's id (u64).")
@click.option("--bootstrap", envvar="KVSTREAM_BOOTSTRAP", help="Kafka bootstrap servers (default: the local broker).")
@click.option("--config", type=click.Path(dir_okay=False), help="TOML settings file.")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), help="[settings: worker.mode, default dedup]")
@click.option("--lease-ms", type=click.IntRange(1), help="[settings: worker.lease_ms, default 10000]")
@click.option("--heartbeat-s", type=click.FloatRange(0.01), help="[settings: worker.heartbeat_s, default 2]")
@click.option("--linger-ms", type=click.FloatRange(0), help="[settings: worker.linger_ms, default 5]")
@click.option("--queue-full", type=click.Choice([q.value for q in QueueFull]), help="[settings: worker.queue_full, default block]")
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="Prometheus port; 0: none. [settings: worker.metrics_port]")
@click.option("--metrics-addr", default="0.0.0.0", show_default=True)
@click.option("--prompts", default=0, show_default=True, type=click.IntRange(0), help="synthetic: prompts to run; 0: until stopped.")
@click.option("--rate", default=20.0, show_default=True, type=click.FloatRange(0.01), help="synthetic: prompts per second.")
@click.option("--seed", default=0, show_default=True, help="synthetic: workload seed.")
@click.option("--device-blocks", default=512, show_default=True, type=click.IntRange(1), help="synthetic: G1 capacity.")
@click.option("--host-blocks", default=2048, show_default=True, type=click.IntRange(1), help="synthetic: G2 capacity.")
@click.option("--disk-blocks", default=0, show_default=True, type=click.IntRange(0), help="synthetic: G3 capacity; 0: no disk tier.")
@click.option("--disk-dir", type=click.Path(file_okay=False, path_type=Path), help="synthetic: where the G3 block file lives.")
def worker(
    engine: str,
    endpoint: str | None,
    replay_endpoint: str | None,
    topic: str,
    dp_rank: int,
    worker_id: int,
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
) -> None:
    """Run a worker: publish an engine's KV-cache events to Kafka (DESIGN.md §3).

    --engine zmq bridges a vLLM or SGLang KV-event publisher; --engine synthetic runs the
    built-in tiered block pool (needs torch) on a seeded workload with shared prefixes."""
    if engine == "synthetic" and disk_blocks and disk_dir is None:
        raise click.UsageError("--disk-blocks needs --disk-dir")
    if engine == "zmq" and not endpoint:
        raise click.UsageError("--engine zmq needs --endpoint (the engine's KV-event PUB address)")
    flags = {
        "mode": mode,
        "lease_ms": lease_ms,
        "heartbeat_s": heartbeat_s,
        "linger_ms": linger_ms,
        "queue_full": queue_full,
        "metrics_port": metrics_port,
    }
    try:
        # Flags over KVSTREAM_WORKER__* over the TOML file's [worker] section.
        settings = load_settings(config, bootstrap=bootstrap, worker={k: v for k, v in flags.items() if v is not None})
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None
    ws = settings.worker
    try:
        options = PublisherOptions(
            worker_id=worker_id,
            lease_ms=ws.lease_ms,
            heartbeat_s=ws.heartbeat_s,
            linger_ms=ws.linger_ms,
            queue_full=QueueFull(ws.queue_full),
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if engine == "synthetic":
        _run_synthetic(
            settings, options, Mode(ws.mode), stop, metrics_addr,
            SyntheticRun(prompts, rate, seed, device_blocks, host_blocks, disk_blocks, disk_dir),
        )
        return
    try:
        publisher = KafkaPublisher(settings, options)
    except (PublisherError, KafkaConfigError) as exc:
        raise click.ClickException(f"cannot start the publisher: {exc}") from None
    consolidator = Consolidator(publisher, Mode(ws.mode))
    bridge = ZmqEngineBridge(
        BridgeOptions(
            endpoint=endpoint,
            replay_endpoint=replay_endpoint,
            topic=topic.encode(),
            default_dp_rank=dp_rank,
        ),
        consolidator,
    )
    left = 0
    try:
        bridge.connect()
        if ws.metrics_port:
            serve_metrics(ws.metrics_port, WorkerCollector(publisher, consolidator, bridge), metrics_addr)
        log.info("worker_started", worker_id=worker_id, epoch=publisher.epoch, endpoint=endpoint, mode=ws.mode)
        run_zmq_worker(publisher, consolidator, bridge, stop)
    except (PublisherError, EngineBridgeError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        bridge.close()
        left = publisher.close()
        log.info("worker_stopped", worker_id=worker_id, batches=publisher.stats.batches, undelivered=left)
    if left:
        raise click.ClickException(f"{left} batches were not acknowledged by Kafka before shutdown")


@dataclass(frozen=True, slots=True)
class SyntheticRun:
    prompts: int
    rate: float
    seed: int
    device_blocks: int
    host_blocks: int
    disk_blocks: int
    disk_dir: Path | None


def _run_synthetic(
    settings: Settings,
    options: PublisherOptions,
    mode: Mode,
    stop: threading.Event,
    metrics_addr: str,
    run: SyntheticRun,
) -> None:
    # torch is imported only here: a zmq worker (and any router host) runs without it.
    from kvstream.worker.node import SyntheticNode, SyntheticNodeOptions
    from kvstream.worker.synthetic import PromptSetOptions, shared_prefix_prompts

    node_options = SyntheticNodeOptions(
        options, mode, device_blocks=run.device_blocks, host_blocks=run.host_blocks,
        disk_blocks=run.disk_blocks or None, disk_dir=run.disk_dir,
    )
    try:
        node = SyntheticNode(settings, node_options)
    except (PublisherError, KafkaConfigError, ValueError) as exc:
        raise click.ClickException(f"cannot start the synthetic worker: {exc}") from None
    ws = settings.worker
    if ws.metrics_port:
        serve_metrics(ws.metrics_port, WorkerCollector(node.publisher, node.consolidator), metrics_addr)
    log.info("worker_started", worker_id=options.worker_id, epoch=node.publisher.epoch, engine="synthetic", mode=mode.value)
    workload = shared_prefix_prompts(PromptSetOptions(prompts=run.prompts or 1 << 62, seed=run.seed))
    period = 1.0 / run.rate
    next_at = time.monotonic()
    done = 0
    try:
        for tokens in workload:
            if stop.is_set():
                break
            node.run_prompt(tokens)
            done += 1
            next_at += period
            while not stop.is_set() and (wait := next_at - time.monotonic()) > 0:
                node.poll()
                stop.wait(min(wait, options.linger_ms / 1000))
    except PublisherError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        left = node.close()
        log.info("worker_stopped", worker_id=options.worker_id, prompts=done, undelivered=left)
    if left:
        raise click.ClickException(f"{left} batches were not acknowledged by Kafka before shutdown")
