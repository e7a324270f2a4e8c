"""``kvstream bench pipeline``: block events per second from real publishers through
the real broker into one replica's index, and the end-to-end lag at a steady rate
(DESIGN.md §11).

Publishers: ``--workers`` :class:`~kvstream.worker.publisher.KafkaPublisher` s (the
worker's real publisher, with its default batching) in a child process, as workers are
other processes than the replica. Each worker stores prompts of ``--prompt-blocks`` new
blocks and, once it holds ``--capacity`` blocks, first removes its oldest prompt, as an
engine at steady state does; block events = stored + removed blocks.

1. Throughput: the publishers write ``--blocks`` stored blocks as fast as they can while
   the replica folds them; the clock runs from the publishers' start to the moment the
   replica has read every record.
2. Replay: a new replica folds that same log from the start (no publisher running).
3. Baseline: a bare confluent-kafka consumer reads the same records, no decode, no
   apply; ``ratio_to_baseline`` = pipeline / baseline.
4. Lag: the publishers offer ``--rate`` blocks/s (default: a quarter of the measured
   throughput) for ``--seconds``; per record, lag = the moment the replica's fold
   returned from applying it − the record's timestamp (set by the producer when the
   publisher hands it the batch; millisecond resolution). It includes librdkafka's
   linger, the broker round trip and the replica's consume batching.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import click
import numpy as np
from confluent_kafka import Consumer, KafkaError, TopicPartition

from kvstream.events.model import Tier
from kvstream.kafka.config import consumer_config
from kvstream.logs import configure_logging, current_logging
from kvstream.replica.fold import Outcome
from kvstream.replica.replica import Replica
from kvstream.settings import Settings, TopicSettings
from bench.common import emit, json_option
from bench.kafka_env import bootstrap_option, high_watermarks, kafka_env, wait_applied, wait_settled
from bench.restart import LEASE_MS, replica_options
from kvstream.worker.consolidator import RouterEventWriter
from kvstream.worker.publisher import KafkaPublisher, PublisherOptions

# -- the publishing side (child process) ------------------------------------------------


@dataclass(frozen=True, slots=True)
class FleetSpec:
    bootstrap: str
    prefix: str
    partitions: int
    workers: int
    prompt_blocks: int
    capacity: int
    seed: int


class _Worker:
    """One worker's publisher and the prompts it holds (its StateSource for resyncs)."""

    def __init__(self, settings: Settings, worker_id: int) -> None:
        self.publisher = KafkaPublisher(
            settings,
            PublisherOptions(worker_id=worker_id, lease_ms=LEASE_MS, heartbeat_s=3600, listen_control=False),
        )
        self.held: deque[tuple[list[int], list[int]]] = deque()
        self.held_blocks = 0

    def replay(self, writer: RouterEventWriter) -> None:
        for hashes, tokens in self.held:
            writer.stored(0, Tier.DEVICE, None, hashes, tokens)

    def store(self, prompt: tuple[list[int], list[int]], capacity: int) -> int:
        """Store a prompt (evicting the oldest ones first); returns the block events."""
        events = 0
        while self.held and self.held_blocks + len(prompt[0]) > capacity:
            hashes, _ = self.held.popleft()
            self.publisher.removed(0, Tier.DEVICE, hashes)
            self.held_blocks -= len(hashes)
            events += len(hashes)
        self.publisher.stored(0, Tier.DEVICE, None, *prompt)
        self.held.append(prompt)
        self.held_blocks += len(prompt[0])
        return events + len(prompt[0])


class _Fleet:
    def __init__(self, spec: FleetSpec) -> None:
        settings = Settings(
            bootstrap=spec.bootstrap,
            topics=TopicSettings(prefix=spec.prefix, events_partitions=spec.partitions),
        )
        self.spec = spec
        self.rng = np.random.default_rng(spec.seed)
        self.workers = [_Worker(settings, i + 1) for i in range(spec.workers)]
        for w in self.workers:  # connect, and write each epoch's opening `cleared`
            if w.publisher.flush(60):
                raise RuntimeError(f"worker {w.publisher.worker_id}: Kafka did not acknowledge its first batch")
        self._turn = 0

    def prompts(self, blocks: int) -> list[tuple[list[int], list[int]]]:
        """Fresh prompts with ``blocks`` blocks in all (random engine ids and local hashes)."""
        n = self.spec.prompt_blocks
        count = max(1, blocks // n)
        raw = self.rng.integers(0, 2**64, (count, 2, n), dtype=np.uint64)
        return [(p[0].tolist(), p[1].tolist()) for p in raw]

    def _next(self) -> _Worker:
        w = self.workers[self._turn]
        self._turn = (self._turn + 1) % len(self.workers)
        return w

    def _stats(self, t0: float, t1: float, events: int) -> dict[str, Any]:
        stats = [w.publisher.stats for w in self.workers]
        return {
            "t0": t0,
            "t1": t1,
            "block_events": events,
            "delivery_failures": sum(s.delivery_failures for s in stats),
            "resyncs": sum(s.resyncs for s in stats),
            "held_blocks": {w.publisher.worker_id: w.held_blocks for w in self.workers},
        }

    def burst(self, blocks: int) -> dict[str, Any]:
        """Store ``blocks`` blocks as fast as the publishers take them, then flush."""
        prompts = self.prompts(blocks)
        cap = self.spec.capacity
        events = 0
        t0 = time.time()
        for i, prompt in enumerate(prompts):
            w = self._next()
            events += w.store(prompt, cap)
            if i % 16 == 15:
                for x in self.workers:
                    x.publisher.poll(x)
        for w in self.workers:
            if w.publisher.flush(120):
                raise RuntimeError("Kafka did not acknowledge every batch within 120s")
        return self._stats(t0, time.time(), events)

    def steady(self, rate: float, seconds: float) -> dict[str, Any]:
        """Offer ``rate`` block events per second for ``seconds``, then flush."""
        prompts = self.prompts(int(rate * seconds * 1.2) + self.spec.prompt_blocks)
        cap = self.spec.capacity
        events = 0
        t0 = time.time()
        end = t0 + seconds
        for prompt in prompts:
            now = time.time()
            if now >= end:
                break
            due = t0 + events / rate
            while now < due:  # pacing; keep batches moving (linger) meanwhile
                for x in self.workers:
                    x.publisher.poll(x)
                time.sleep(min(0.0005, due - now))
                now = time.time()
            events += self._next().store(prompt, cap)
            for x in self.workers:
                x.publisher.poll(x)
        for w in self.workers:
            if w.publisher.flush(120):
                raise RuntimeError("Kafka did not acknowledge every batch within 120s")
        return self._stats(t0, time.time(), events)

    def close(self) -> None:
        for w in self.workers:
            w.publisher.close()


def _fleet_main(factory: Callable[[Any], Any], spec: Any, conn: Connection, logging: tuple[str, str]) -> None:
    """Child process: run the fleet's commands from the parent until told to stop."""
    # A spawned process logs to stdout until configured: into the parent's --json answer.
    configure_logging(*logging)
    fleet = None
    try:
        fleet = factory(spec)
        conn.send(("ok", None))
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                return
            conn.send(("ok", getattr(fleet, cmd)(*args)))
    except Exception as exc:  # report to the parent rather than die silently
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if fleet is not None:
            fleet.close()
        conn.close()


class FleetProcess:
    """A bench's publishers (or replicas) in a child process (spawned: the parent holds
    Kafka clients' threads, which must not be forked): ``factory(spec)`` there (a
    module-level class, default the pipeline's fleet), whose methods :meth:`call` runs;
    it has a ``close``."""

    def __init__(self, spec: Any, factory: Callable[[Any], Any] = _Fleet) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_fleet_main, args=(factory, spec, child, current_logging()),
            name=f"kvstream-bench-{factory.__name__}", daemon=True,
        )
        self._proc.start()
        child.close()
        self.answer(300)

    def answer(self, timeout: float) -> Any:
        """The answer to the command sent last (:meth:`send`)."""
        if not self._conn.poll(timeout):
            raise click.ClickException(f"the child process ({self._proc.name}) did not answer within {timeout:.0f}s")
        status, value = self._conn.recv()
        if status != "ok":
            raise click.ClickException(f"the child process ({self._proc.name}) failed: {value}")
        return value

    def send(self, cmd: str, *args: Any) -> None:
        """Start ``cmd`` in the child; :meth:`answer` waits for its result (the parent
        may drive several children at once meanwhile)."""
        self._conn.send((cmd, *args))

    def call(self, cmd: str, *args: Any, timeout: float = 600) -> Any:
        self.send(cmd, *args)
        return self.answer(timeout)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
        self._proc.join(60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


# -- the replica side ---------------------------------------------------------------------


class ApplyClock:
    """Wraps a fold's ``apply_record`` to note, per record, its timestamp and the wall
    time at which applying it finished, and to count the events it applied (only while
    ``on``)."""

    def __init__(self, apply: Callable[..., Outcome]) -> None:
        self._apply = apply
        self.on = False
        self.samples: list[tuple[int, float]] = []
        self.applied_events = 0

    def __call__(
        self, partition: int, offset: int, timestamp_ms: int, value: bytes | None, is_tick: bool = False,
        key: bytes | None = None, problem: str | None = None,
    ) -> Outcome:
        out = self._apply(partition, offset, timestamp_ms, value, is_tick, key, problem)
        if self.on and not is_tick:
            self.samples.append((timestamp_ms, time.time()))
            self.applied_events += out.applied_events
        return out


def raw_consume(settings: Settings, targets: dict[int, int], timeout: float) -> float:
    """Seconds a bare consumer (replica settings, no decode) takes to read every record
    of the events topic below ``targets``."""
    topic = settings.topics.name("events")
    consumer = Consumer(consumer_config(settings))
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in targets])
        left = {p for p, hw in targets.items() if hw > 0}
        deadline = time.monotonic() + timeout
        t0 = time.perf_counter()
        while left:
            for m in consumer.consume(2000, 0.05):
                err = m.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        raise click.ClickException(f"baseline consumer: {err}")
                    continue
                if m.offset() + 1 >= targets[m.partition()]:
                    left.discard(m.partition())
            if time.monotonic() > deadline:
                raise click.ClickException(f"baseline consumer did not finish within {timeout:.0f}s")
        return time.perf_counter() - t0
    finally:
        consumer.close()


def _held_in_index(replica: Replica) -> dict[int, int]:
    with replica.lock:
        return {
            k.worker_id: tiers[Tier.DEVICE] for k, tiers in replica.router.tree_sizes().items()
        }


def _check_index(replica: Replica, held: dict[int, int], what: str) -> None:
    """The replica must hold exactly what the publishers hold, having rejected nothing."""
    got = _held_in_index(replica)
    want = {int(w): n for w, n in held.items()}
    if got != want:
        raise click.ClickException(f"{what}: the index holds {sum(got.values())} blocks, the workers {sum(want.values())}")
    with replica.lock:
        counters = {k: v for k, v in replica.fold.rejections().items() if v}
    if counters:
        raise click.ClickException(f"{what}: events rejected or skipped: {counters}")


@click.command("pipeline")
@bootstrap_option
@click.option("--blocks", "n_blocks", default=2_000_000, show_default=True, help="Blocks stored in the throughput phase.")
@click.option("--workers", "n_workers", default=8, show_default=True, help="Publishers (worker ids 1..N).")
@click.option("--prompt-blocks", default=256, show_default=True, help="Blocks per stored prompt.")
@click.option("--capacity", default=50_000, show_default=True, help="Blocks a worker holds before it evicts.")
@click.option("--partitions", default=12, show_default=True, help="Partitions of the events topic.")
@click.option("--rate", default=0.0, show_default=True, help="Offered block events/s in the lag phase (0: a quarter of the measured throughput).")
@click.option("--seconds", default=10.0, show_default=True, help="Length of the lag phase.")
@click.option("--timeout", default=600.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@json_option
def pipeline_bench(
    bootstrap: str | None,
    n_blocks: int,
    n_workers: int,
    prompt_blocks: int,
    capacity: int,
    partitions: int,
    rate: float,
    seconds: float,
    timeout: float,
    seed: int,
    as_json: bool,
) -> None:
    """KafkaPublisher → Kafka → replica index: block events/s and lag p50/p99."""
    with kafka_env(bootstrap, events_partitions=partitions) as settings:
        spec = FleetSpec(
            settings.bootstrap or "", settings.topics.prefix, partitions, n_workers, prompt_blocks, capacity, seed
        )
        click.echo(f"starting {n_workers} publishers and a replica...", err=True)
        fleet = FleetProcess(spec)
        try:
            result = _run(settings, fleet, n_blocks, rate, seconds, timeout)
        finally:
            fleet.close()
    emit(
        {
            "bench": "pipeline",
            "publisher": "kvstream.worker.publisher.KafkaPublisher (child process)",
            "workers": n_workers,
            "prompt_blocks": prompt_blocks,
            "capacity": capacity,
            "partitions": partitions,
            **result,
        },
        as_json,
    )


def _run(settings: Settings, fleet: FleetProcess, n_blocks: int, rate: float, seconds: float, timeout: float) -> dict[str, Any]:
    replica = Replica(settings, replica_options(None))
    clock = ApplyClock(replica.fold.apply_record)
    replica.fold.apply_record = clock  # type: ignore[method-assign]
    replica.start()
    try:
        wait_settled(replica, settings, timeout, "replica reading the empty log")
        # 1. throughput
        start_offsets = high_watermarks(settings)
        cpu0 = time.process_time()
        burst = fleet.call("burst", n_blocks, timeout=timeout)
        targets = high_watermarks(settings)
        done_at = wait_applied(replica, targets, timeout, "replica folding the burst")
        replica_cpu_s = time.process_time() - cpu0
        _check_index(replica, burst["held_blocks"], "after the burst")
        events = burst["block_events"]
        pipeline_s = done_at - burst["t0"]
        publish_s = burst["t1"] - burst["t0"]
        records = sum(targets.values()) - sum(start_offsets.values())

        # 2. replay of the same log by a new replica
        fresh = Replica(settings, replica_options(None))
        t0, cpu0 = time.perf_counter(), time.process_time()
        fresh.start()
        try:
            wait_applied(fresh, targets, timeout, "new replica replaying it")
            replay_s = time.perf_counter() - t0
            replay_cpu_s = time.process_time() - cpu0
        finally:
            fresh.stop()

        # 3. baseline: the same records, consumed only
        base_s = raw_consume(settings, targets, timeout)

        # 4. lag at a steady offered rate
        offered = rate or events / pipeline_s / 4
        click.echo(f"offering {offered:,.0f} block events/s for {seconds:g}s...", err=True)
        clock.on = True
        steady = fleet.call("steady", offered, seconds, timeout=timeout + seconds)
        wait_applied(replica, high_watermarks(settings), timeout, "replica folding the steady phase")
        clock.on = False
        _check_index(replica, steady["held_blocks"], "after the steady phase")
    finally:
        replica.stop()
    lags = np.array([now * 1000 - ts for ts, now in clock.samples])
    if not len(lags):
        raise click.ClickException("no record was applied during the lag phase")
    pipeline = events / pipeline_s
    baseline = events / base_s
    steady_s = steady["t1"] - steady["t0"]
    return {
        "block_events": events,
        "records": records,
        "blocks_per_s": round(pipeline),
        "seconds": round(pipeline_s, 3),
        "publish_only_blocks_per_s": round(events / publish_s),
        "replay_blocks_per_s": round(events / replay_s),
        # CPU of the replica's process (librdkafka's threads included): on a shared
        # machine, wall time also counts other processes' turns.
        "replica_blocks_per_cpu_s": round(events / replica_cpu_s),
        "replay_blocks_per_cpu_s": round(events / replay_cpu_s),
        "baseline": "confluent-kafka consume of the same records, no decode or apply",
        "baseline_blocks_per_s": round(baseline),
        "ratio_to_baseline": round(pipeline / baseline, 3),
        "replay_ratio_to_baseline": round(base_s / replay_s, 3),
        "lag_offered_blocks_per_s": round(offered),
        "lag_achieved_blocks_per_s": round(steady["block_events"] / steady_s),
        "lag_records": len(lags),
        "lag_p50_ms": round(float(np.percentile(lags, 50)), 2),
        "lag_p99_ms": round(float(np.percentile(lags, 99)), 2),
        "lag_max_ms": round(float(lags.max()), 2),
        "delivery_failures": burst["delivery_failures"] + steady["delivery_failures"],
    }
