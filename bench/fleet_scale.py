"""``kvstream bench fleet-scale``: a fleet of ``--workers`` workers' KV event streams,
played live into a multi-partition topic on a real broker, folded by one real replica
while routing decisions are timed against it (issue 35, item 3; docs/SCALE.md).

Each worker is a tiered pool (DESIGN.md §8) as the routers see it through a passthrough
consolidator (§3): every request stores a fresh chain of ``request_blocks`` blocks on the
device (G1), the write-through offload stores it on host (G2) and, on its first sighting,
on disk (G3); a tier over its capacity evicts its least recently stored chain first,
leaves before parents. At steady state each new block is therefore 6 block events
(stored and removed on each of three tiers): a worker prefilling ``new_tokens_per_s``
uncached tokens in blocks of ``block_size`` offers ``6 * new_tokens_per_s / block_size``
block events/s (8,000 tokens/s, blocks of 16: 3,000/s; the arithmetic is in
docs/SCALE.md). Workers restart at ``--restarts-per-s`` across the fleet: a new epoch
that opens with ``cleared`` and empty tiers. The pool names blocks by sequence hash on
every tier, so a passthrough consolidator forwards them unchanged: the streams go
straight into the publisher's batcher (:class:`~kvstream.worker.batcher.EventBatcher`,
cut every linger of simulated time, at the publisher's limits) and the project's codec,
which is exactly what a worker's publisher writes.

The load runs in a child process (:class:`bench.pipeline.FleetProcess`). The fleet grows
in steps (``--steps``, default fractions of ``--workers`` from 1/16 to 1): at each step the
workers that join publish their full state as a resync does (``cleared``, then their
tiers filled: untimed), then every active worker plays ``--seconds`` of its stream,
generated first and produced paced, each linger's records at their moment. Per step:
offered block events/s (as produced) against the target, folded block events/s (from the
first record produced to the moment the replica has read the last) and per CPU second of
the replica's process (routes taken out: what other jobs on the machine do not inflate), lag (per record, the
moment the fold applied it minus the record's timestamp), the route latency of
``replica.route`` called ``--route-rate`` times a second meanwhile, RSS and blocks held.
A step *follows* when its lag p99 is at most ``--lag-bound-ms`` and the replica folded
at least 95 % of the offered rate; ``workers_followed`` is the largest such step whose
generator kept 95 % of real time's pace. After a step that does not follow, the
steps before the last are skipped. At the end the replica must hold, per worker and
tier, as many blocks as the worker's pool, with nothing rejected; ``index_digest`` (every
held hash) is what tests/tools/test_bench_fleet_scale.py compares with a reference fold.

``--shards S`` (S > 1) measures the index sharded by chain root (docs/SCALE.md): each
chain's events go to the topic of shard ``root % S`` (root: the sequence hash of the
chain's first block), each worker publishing one ordered stream per shard (its own
event ids, ``cleared`` to every shard), and S replicas, each in a process of its own,
fold one shard each. Per step: each shard's folded block events/s and lag, and the
whole's; no routing is timed (a route goes to one shard).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Any

import click
import numpy as np
from confluent_kafka import Producer

from kvstream.events.codec import EventCodec
from kvstream.events.model import EventBatch, Tier
from kvstream.events.wire import worker_key
from kvstream.hashing import block_hashes
from kvstream.kafka.config import producer_config
from kvstream.replica.replica import Replica
from kvstream.router.index import WorkerKey
from kvstream.settings import Settings, TopicSettings
from kvstream.worker.announce import register_synthetic
from kvstream.worker.batcher import EventBatcher
from kvstream.worker.options import DEFAULTS
from kvstream.worker.publisher import PublisherOptions
from bench.common import emit, json_option, percentiles_us, rss_bytes
from bench.kafka_env import (
    bench_topics, bootstrap_option, broker, high_watermarks, produce_records, wait_applied, wait_settled,
)
from bench.pipeline import ApplyClock, FleetProcess
from bench.restart import LEASE_MS, replica_options

#: The tiers a worker's pool offloads through, in order (DESIGN.md §8).
TIERS = (Tier.DEVICE, Tier.HOST_PINNED, Tier.DISK)
#: Token ids are drawn below a 152k vocabulary (the hashes do not depend on it).
VOCAB = 152_000
#: Share of the offered rate the replica must fold, and of real time the generator must
#: keep pace with, for a step to count.
KEEP_UP = 0.95
#: The publisher's batch limits.
_PUBLISHER = PublisherOptions(worker_id=0)
#: Prompts handed to the routing thread per step.
ROUTE_PROMPTS = 64

#: A record of the load: (shard, worker id, encoded EventBatch).
ShardRecord = tuple[int, int, bytes]


def chain_shard(root: int, shards: int) -> int:
    """The shard of a chain whose first block has sequence hash ``root`` (an XXH3 hash:
    uniform, so its residue spreads chains evenly)."""
    return root % shards


@dataclass(frozen=True, slots=True)
class WorkerProfile:
    """One worker's traffic and tiers; the defaults are scaled-down tiers (steady state
    within a short run) at a 70B model's realistic rate (docs/SCALE.md)."""

    block_size: int = 16
    #: Uncached prompt tokens the worker prefills per second (new blocks, 16 each).
    new_tokens_per_s: float = 8_000.0
    #: New blocks a request stores (a chain from the root; 512 tokens).
    request_blocks: int = 32
    device_blocks: int = 128
    host_blocks: int = 640
    disk_blocks: int = 2_560

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.request_blocks < 1 or self.new_tokens_per_s <= 0:
            raise click.BadParameter("block size, request blocks and new tokens/s must be positive")
        caps = (self.device_blocks, self.host_blocks, self.disk_blocks)
        if min(caps) < self.request_blocks:
            raise click.BadParameter(f"every tier must hold at least one request ({self.request_blocks} blocks): {caps}")

    @property
    def requests_per_s(self) -> float:
        return self.new_tokens_per_s / self.block_size / self.request_blocks

    @property
    def events_per_s(self) -> float:
        """Block events/s at steady state: each new block stored and evicted on 3 tiers."""
        return 2 * len(TIERS) * self.new_tokens_per_s / self.block_size

    def capacity(self, tier: Tier) -> int:
        return {Tier.DEVICE: self.device_blocks, Tier.HOST_PINNED: self.host_blocks, Tier.DISK: self.disk_blocks}[tier]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    bootstrap: str
    #: Topic prefix of each shard (one: the index unsharded).
    prefixes: tuple[str, ...]
    partitions: int
    profile: WorkerProfile
    seconds: float
    restarts_per_s: float
    seed: int

    @property
    def shards(self) -> int:
        return len(self.prefixes)


class _Chain:
    __slots__ = ("seqs", "local", "tokens", "shard")

    def __init__(self, seqs: list[int], local: list[int], tokens: np.ndarray, shard: int) -> None:
        self.seqs, self.local, self.tokens, self.shard = seqs, local, tokens, shard


class TieredWorker:
    """One worker's pool as its passthrough consolidator publishes it, into one batcher
    per shard."""

    def __init__(self, worker_id: int, profile: WorkerProfile, seed: int, batchers: Sequence[EventBatcher]) -> None:
        self.worker_id = worker_id
        self.profile = profile
        self.rng = np.random.default_rng([seed, worker_id])
        self.batchers = batchers
        self.tiers: dict[Tier, deque[_Chain]] = {t: deque() for t in TIERS}
        self.held = dict.fromkeys(TIERS, 0)
        self.epoch = 0
        #: Simulated time of the next request.
        self.next_at = 0.0

    def restart(self, fill: bool) -> None:
        """A new incarnation (``cleared`` on every shard, empty tiers); ``fill``: then its
        tiers full, published as a worker answering a resync publishes its state (each
        tier's chains, no evictions)."""
        self.epoch += 1
        for b in self.batchers:
            b.start_epoch(self.epoch)
        for t in TIERS:
            self.tiers[t].clear()
            self.held[t] = 0
        if fill:
            p = self.profile
            chains = [self._chain() for _ in range(p.disk_blocks // p.request_blocks)]
            for t in TIERS:  # the newest chains are on the upper tiers too
                for c in chains[-(p.capacity(t) // p.request_blocks):]:
                    self._store(t, c)

    def request(self) -> None:
        """A request's fresh chain stored on every tier (write-through)."""
        chain = self._chain()
        for t in TIERS:
            self._store(t, chain)

    def _chain(self) -> _Chain:
        p = self.profile
        tokens = self.rng.integers(0, VOCAB, p.request_blocks * p.block_size, dtype=np.uint32)
        local, seqs = block_hashes(tokens.tolist(), p.block_size)
        return _Chain(seqs, local, tokens, chain_shard(seqs[0], len(self.batchers)))

    def _store(self, tier: Tier, chain: _Chain) -> None:
        """Store ``chain`` on ``tier``, evicting its oldest chains first as needed."""
        queue = self.tiers[tier]
        n = len(chain.seqs)
        while self.held[tier] + n > self.profile.capacity(tier):
            old = queue.popleft()
            self.batchers[old.shard].removed(0, tier, old.seqs[::-1])  # leaves before parents
            self.held[tier] -= len(old.seqs)
        # The batcher owns the lists it is given.
        self.batchers[chain.shard].stored(0, tier, None, list(chain.seqs), list(chain.local))
        queue.append(chain)
        self.held[tier] += n


class FleetLoad:
    """The fleet's streams as records: deterministic given the spec (the test regenerates
    them to fold with the reference), no I/O."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.codec = EventCodec()
        self.workers: list[TieredWorker] = []
        self.rng = np.random.default_rng([spec.seed, 0])
        # Prompts draw from their own generator: asking for them leaves the streams as
        # they are (the test regenerates the streams without asking).
        self._prompt_rng = np.random.default_rng([spec.seed, 0, 1])
        #: Simulated seconds played; one tick is the publisher's linger.
        self.now = 0.0
        self.tick_s = DEFAULTS.linger_ms / 1000
        self._out: list[ShardRecord] = []
        #: Router events and block events (blocks stored + removed) written so far, per shard.
        self.events = [0] * spec.shards
        self.block_events = [0] * spec.shards

    def _batcher(self, wid: int, shard: int) -> EventBatcher:
        def emit_batch(batch: EventBatch, blocks: int) -> None:
            self._out.append((shard, batch.worker_id, self.codec.encode(batch)))
            self.events[shard] += len(batch.events)
            self.block_events[shard] += blocks

        return EventBatcher(
            wid, LEASE_MS, _PUBLISHER.max_batch_events, _PUBLISHER.max_batch_blocks, emit_batch, clock=lambda: self.now
        )

    def _cut(self, workers: Sequence[TieredWorker]) -> list[ShardRecord]:
        for w in workers:
            for b in w.batchers:
                b.cut()
        out, self._out = self._out, []
        return out

    def join(self, n_workers: int) -> list[ShardRecord]:
        """Workers up to ``n_workers`` join with full tiers: their records."""
        spec = self.spec
        new = []
        for wid in range(len(self.workers) + 1, n_workers + 1):
            w = TieredWorker(wid, spec.profile, spec.seed, [self._batcher(wid, s) for s in range(spec.shards)])
            # Spread the workers' requests over a request's interval.
            w.next_at = self.now + float(self.rng.uniform(0, 1 / spec.profile.requests_per_s))
            new.append(w)
        self.workers.extend(new)
        for w in new:
            w.restart(fill=True)
        return self._cut(new)

    def play(self) -> tuple[list[list[ShardRecord]], int]:
        """``spec.seconds`` of every worker's stream: the records of each tick, and the
        restarts."""
        spec = self.spec
        n_ticks = max(1, round(spec.seconds / self.tick_s))
        start = self.now
        interval = 1 / spec.profile.requests_per_s
        due: list[list[TieredWorker]] = [[] for _ in range(n_ticks)]
        for w in self.workers:
            while w.next_at < start + n_ticks * self.tick_s:
                due[int((w.next_at - start) / self.tick_s)].append(w)
                w.next_at += interval
        restarts: list[list[TieredWorker]] = [[] for _ in range(n_ticks)]
        n_restarts = int(self.rng.poisson(spec.restarts_per_s * n_ticks * self.tick_s))
        for _ in range(n_restarts):
            restarts[int(self.rng.integers(n_ticks))].append(self.workers[int(self.rng.integers(len(self.workers)))])
        ticks = []
        for k in range(n_ticks):
            self.now = start + k * self.tick_s
            for w in restarts[k]:
                w.restart(fill=False)
            for w in due[k]:
                w.request()
            ticks.append(self._cut([*restarts[k], *due[k]]))
        self.now = start + n_ticks * self.tick_s
        return ticks, n_restarts

    def held(self) -> dict[int, dict[str, int]]:
        return {w.worker_id: {t.value: n for t, n in w.held.items()} for w in self.workers}

    def prompts(self, n: int) -> list[list[int]]:
        """``n`` prompts, each a chain on some worker's device and 4 blocks more."""
        chains = [c for w in self.workers for c in w.tiers[Tier.DEVICE]]
        if not chains:
            return []
        rng, bs = self._prompt_rng, self.spec.profile.block_size
        return [
            [*chains[int(rng.integers(len(chains)))].tokens.tolist(), *rng.integers(0, VOCAB, 4 * bs).tolist()]
            for _ in range(n)
        ]


def shard_settings(bootstrap: str, prefix: str, partitions: int) -> Settings:
    return Settings(bootstrap=bootstrap, topics=TopicSettings(prefix=prefix, events_partitions=partitions))


class LoadProcess:
    """:class:`FleetLoad` with a producer, run in the child process."""

    def __init__(self, spec: LoadSpec) -> None:
        self.load = FleetLoad(spec)
        self.settings = [shard_settings(spec.bootstrap, p, spec.partitions) for p in spec.prefixes]
        self.topics = [s.topics.name("events") for s in self.settings]
        self.producer = Producer(producer_config(self.settings[0], **{"client.id": "kvstream-bench-fleet-scale"}))
        self.failures: list[str] = []

    def _counts(self, before: tuple[list[int], list[int]]) -> dict[str, Any]:
        events = [a - b for a, b in zip(self.load.events, before[0])]
        blocks = [a - b for a, b in zip(self.load.block_events, before[1])]
        return {"events": sum(events), "block_events": sum(blocks), "block_events_by_shard": blocks}

    def _before(self) -> tuple[list[int], list[int]]:
        return list(self.load.events), list(self.load.block_events)

    def join(self, n_workers: int) -> dict[str, Any]:
        before = self._before()
        records = self.load.join(n_workers)
        for shard, settings in enumerate(self.settings):
            mine = [(wid, value) for s, wid, value in records if s == shard]
            produce_records(settings, mine, desc=f"{n_workers} workers' state")
        return {**self._counts(before), "prompts": self.load.prompts(ROUTE_PROMPTS)}

    def _delivered(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self.failures.append(str(err))

    def play(self) -> dict[str, Any]:
        """Generate the step (untimed), then produce each tick's records at its moment."""
        before = self._before()
        ticks, restarts = self.load.play()
        produce, poll, topics = self.producer.produce, self.producer.poll, self.topics
        tick_s = self.load.tick_s
        t0 = time.time()
        for k, records in enumerate(ticks):
            wait = t0 + k * tick_s - time.time()
            if wait > 0:
                time.sleep(wait)
            for shard, wid, value in records:
                while True:
                    try:
                        produce(topics[shard], value=value, key=worker_key(wid), on_delivery=self._delivered)
                        break
                    except BufferError:  # the client's queue is full: let deliveries make room
                        poll(0.01)
            poll(0)
        t1 = time.time()
        if self.producer.flush(120) or self.failures:
            raise RuntimeError(f"Kafka did not acknowledge every record: {self.failures[:1]}")
        return {
            **self._counts(before), "restarts": restarts, "records": sum(map(len, ticks)), "t0": t0, "t1": t1,
            "played_s": len(ticks) * tick_s,
        }

    def held(self) -> dict[int, dict[str, int]]:
        return self.load.held()

    def close(self) -> None:
        self.producer.flush(30)


def index_digest(held: Mapping[tuple[int, int, str], Sequence[int]]) -> str:
    """SHA-256 over every (worker, rank, tier)'s held block hashes, sorted: two indexes
    with the same digest hold the same blocks."""
    h = hashlib.sha256()
    for key in sorted(k for k, v in held.items() if len(v)):
        h.update(repr(key).encode())
        h.update(np.sort(np.asarray(held[key], dtype=np.uint64)).tobytes())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class FollowerSpec:
    bootstrap: str
    prefix: str
    partitions: int


class Follower:
    """A real replica folding one shard's topic, its fold's applies clocked
    (:class:`bench.pipeline.ApplyClock`); in this process or in a child of its own."""

    def __init__(self, spec: FollowerSpec) -> None:
        self.settings = shard_settings(spec.bootstrap, spec.prefix, spec.partitions)
        self.replica = Replica(self.settings, replica_options(None))
        self.clock = ApplyClock(self.replica.fold.apply_record)
        self.replica.fold.apply_record = self.clock  # type: ignore[method-assign]
        self.replica.start()
        #: When the lag samples were last cleared, and the process's CPU time then.
        self.since, self.cpu0 = time.time(), time.process_time()

    def settle(self, timeout: float) -> None:
        wait_settled(self.replica, self.settings, timeout, "replica reading the empty log")

    def watch(self) -> None:
        """Note lags and count applied events from now on."""
        self.clock.on = True

    def caught_up(self, timeout: float, desc: str, clear: bool = False) -> float:
        """Wait until the replica has read its topic to the end; returns when it had
        (``time.time()``). ``clear``: then drop the lag samples noted so far and start
        counting CPU time again."""
        done_at = wait_applied(self.replica, high_watermarks(self.settings), timeout, desc)
        if clear:
            self.clock.samples = []
            self.since, self.cpu0 = time.time(), time.process_time()
        return done_at

    def measure(self) -> dict[str, Any]:
        """Lags (ms) of the records applied and this process's CPU seconds (every
        thread: the Kafka client's, the fold's, routes where it routes) since the last
        clear; events applied since the start; blocks held and memory."""
        replica = self.replica
        with replica.lock:
            blocks = sum(sum(tiers.values()) for tiers in replica.router.tree_sizes().values())
            index_bytes = replica.router.index_heap_bytes()
        return {
            "lags_ms": [applied * 1000 - ts for ts, applied in self.clock.samples],
            "cpu_s": time.process_time() - self.cpu0,
            "since": self.since,
            "applied_events": self.clock.applied_events,
            "blocks_held": blocks,
            "index_bytes": index_bytes,
            "rss_bytes": rss_bytes(),
        }

    def held(self) -> dict[tuple[int, int, str], list[int]]:
        with self.replica.lock:
            router = self.replica.router
            return {
                (k.worker_id, k.dp_rank, t.value): list(router.blocks(WorkerKey(k.worker_id, k.dp_rank), t))
                for k, tiers in router.tree_sizes().items()
                for t, n in tiers.items()
                if n
            }

    def rejected(self) -> dict[str, int]:
        with self.replica.lock:
            return {k: v for k, v in self.replica.fold.rejections().items() if v}

    def close(self) -> None:
        self.replica.stop()


class _Here:
    """A :class:`Follower` in this process, driven as the children are (send, answer)."""

    def __init__(self, follower: Follower) -> None:
        self.follower = follower
        self._result: Any = None

    def send(self, cmd: str, *args: Any) -> None:
        self._result = getattr(self.follower, cmd)(*args)

    def answer(self, timeout: float) -> Any:
        return self._result

    def close(self) -> None:
        self.follower.close()


class RouteClock:
    """Routes a prompt ``rate`` times a second on its own thread (the replica's HTTP
    server routes in its process too), noting when each ended and how long it took."""

    def __init__(self, replica: Replica, rate: float) -> None:
        self.replica, self.interval = replica, 1 / rate
        self.prompts: list[list[int]] = []
        self.samples: list[tuple[float, int]] = []
        #: (when it ended, CPU ns of this thread) per route, to take out of the process's.
        self.cpu: list[tuple[float, int]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-route", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        k = 0
        clock = time.perf_counter_ns
        while not self._stop.wait(self.interval):
            prompts = self.prompts
            if not prompts:
                continue
            t0, c0 = clock(), time.thread_time_ns()
            try:
                self.replica.route(prompts[k % len(prompts)], query_only=True)
            except Exception:  # counted: a route that fails is a finding, not a crash
                self.errors += 1
                continue
            now = time.time()
            self.samples.append((now, clock() - t0))
            self.cpu.append((now, time.thread_time_ns() - c0))
            k += 1

    def window(self, t0: float, t1: float) -> list[int]:
        return [ns for t, ns in self.samples if t0 <= t <= t1]

    def cpu_s(self, t0: float, t1: float) -> float:
        return sum(ns for t, ns in self.cpu if t0 <= t <= t1) / 1e9

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


#: Default steps, as fractions of ``--workers``: finer where one replica's limit was found
#: on a 2-core machine (between a quarter and a half of 1,000 workers).
STEP_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1)


def default_steps(n_workers: int) -> list[int]:
    return sorted({max(1, round(n_workers * f)) for f in STEP_FRACTIONS})


def parse_steps(spec: str | None, n_workers: int) -> list[int]:
    if n_workers < 1:
        raise click.BadParameter("--workers must be at least 1")
    if not spec:
        return default_steps(n_workers)
    try:
        steps = sorted({int(s) for s in spec.split(",") if s.strip()})
    except ValueError:
        raise click.BadParameter(f"--steps takes worker counts separated by commas, not {spec!r}") from None
    if not steps or steps[0] < 1 or steps[-1] != n_workers:
        raise click.BadParameter(f"--steps must be positive worker counts ending at --workers ({n_workers})")
    return steps


_PROFILE = WorkerProfile()


@click.command("fleet-scale")
@bootstrap_option
@click.option("--workers", "n_workers", default=1_000, show_default=True, help="Workers in the fleet (the last step).")
@click.option("--steps", default=None, help="Worker counts of the steps, comma-separated, ending at --workers [default: N/16, N/8, N/4, 3N/8, N/2, 3N/4, N].")
@click.option("--seconds", default=5.0, show_default=True, help="Seconds each step plays.")
@click.option("--new-tokens-per-s", default=_PROFILE.new_tokens_per_s, show_default=True, help="Uncached prompt tokens a worker prefills per second.")
@click.option("--block-size", default=_PROFILE.block_size, show_default=True)
@click.option("--request-blocks", default=_PROFILE.request_blocks, show_default=True, help="New blocks per request.")
@click.option("--device-blocks", default=_PROFILE.device_blocks, show_default=True, help="G1 capacity per worker.")
@click.option("--host-blocks", default=_PROFILE.host_blocks, show_default=True, help="G2 capacity per worker.")
@click.option("--disk-blocks", default=_PROFILE.disk_blocks, show_default=True, help="G3 capacity per worker.")
@click.option("--restarts-per-s", default=0.5, show_default=True, help="Worker restarts per second across the fleet.")
@click.option("--partitions", default=16, show_default=True, help="Partitions of the events topic (of each shard's).")
@click.option("--shards", default=1, show_default=True, help="Shards of the index by chain root, one replica process each (1: one replica in this process, routes timed).")
@click.option("--route-rate", default=200.0, show_default=True, help="Routing decisions per second during the steps (one shard only).")
@click.option("--lag-bound-ms", default=1_000.0, show_default=True, help="Lag p99 at most this for a step to count as followed.")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds the replica may take to catch up after a step.")
@click.option("--seed", default=0, show_default=True)
@json_option
def fleet_scale_bench(
    bootstrap: str | None, n_workers: int, steps: str | None, seconds: float, new_tokens_per_s: float,
    block_size: int, request_blocks: int, device_blocks: int, host_blocks: int, disk_blocks: int,
    restarts_per_s: float, partitions: int, shards: int, route_rate: float, lag_bound_ms: float, timeout: float,
    seed: int, as_json: bool,
) -> None:
    """A fleet's tiered KV event streams live into one replica (or one per shard):
    events/s offered and folded, lag p99, route p99, RSS, and how many workers it follows."""
    step_list = parse_steps(steps, n_workers)
    profile = WorkerProfile(block_size, new_tokens_per_s, request_blocks, device_blocks, host_blocks, disk_blocks)
    if seconds <= 0 or partitions < 1 or shards < 1 or route_rate <= 0 or restarts_per_s < 0 or lag_bound_ms <= 0:
        raise click.BadParameter(
            "--seconds, --partitions, --shards, --route-rate, --lag-bound-ms must be positive, --restarts-per-s >= 0"
        )
    load_avg = [os.getloadavg()[0]]
    with broker(bootstrap) as servers, ExitStack() as topics:
        prefixes = []
        for _ in range(shards):
            settings = topics.enter_context(bench_topics(servers, events_partitions=partitions))
            register_synthetic(settings, range(1, n_workers + 1), block_size)  # routers admit registered workers only
            prefixes.append(settings.topics.prefix)
        spec = LoadSpec(servers, tuple(prefixes), partitions, profile, seconds, restarts_per_s, seed)
        click.echo(
            f"starting the load generator and {shards} replica(s) ({n_workers} workers at "
            f"{profile.events_per_s:,.0f} block events/s each)...", err=True,
        )
        with ExitStack() as procs:
            load = FleetProcess(spec, LoadProcess)
            procs.callback(load.close)
            followers: list[Any] = []
            for prefix in prefixes:
                fspec = FollowerSpec(servers, prefix, partitions)
                followers.append(_Here(Follower(fspec)) if shards == 1 else FleetProcess(fspec, Follower))
                procs.callback(followers[-1].close)
            route = RouteClock(followers[0].follower.replica, route_rate) if shards == 1 else None
            if route is not None:
                procs.callback(route.stop)
            result = _run(load, followers, route, step_list, profile, lag_bound_ms, timeout)
    load_avg.append(os.getloadavg()[0])
    emit(
        {
            "bench": "fleet-scale",
            "workers": n_workers,
            "per_worker_block_events_per_s": profile.events_per_s,
            "target_block_events_per_s": round(profile.events_per_s * n_workers),
            "profile": asdict(profile),
            "seconds_per_step": seconds,
            "partitions": partitions,
            "shards": shards,
            "restarts_per_s": restarts_per_s,
            "lag_bound_ms": lag_bound_ms,
            "seed": seed,
            **result,
            "load_average_1m": load_avg,
        },
        as_json,
    )


def _all(followers: Sequence[Any], cmd: str, *args: Any, timeout: float) -> list[Any]:
    """``cmd`` on every follower at once (each child waits for its own shard), then
    their answers."""
    for f in followers:
        f.send(cmd, *args)
    return [f.answer(timeout) for f in followers]


def _run(
    load: FleetProcess, followers: Sequence[Any], route: RouteClock | None, steps: list[int], profile: WorkerProfile,
    lag_bound_ms: float, timeout: float,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    played: list[int] = []
    events_offered = 0
    _all(followers, "settle", timeout, timeout=timeout)
    _all(followers, "watch", timeout=timeout)
    if route is not None:
        route.start()
    for n in steps:
        if rows and not rows[-1]["followed"] and n != steps[-1]:
            continue  # past what one replica follows: go to the whole fleet
        joined = load.call("join", n, timeout=timeout)
        _all(followers, "caught_up", timeout, f"{n} workers joining", True, timeout=timeout)
        if route is not None:
            route.prompts = joined["prompts"]
        click.echo(f"{n} workers: offering {n * profile.events_per_s:,.0f} block events/s...", err=True)
        step = load.call("play", timeout=timeout)
        done = _all(followers, "caught_up", timeout, f"replicas folding {n} workers", timeout=timeout)
        measured = _all(followers, "measure", timeout=timeout)
        events_offered += joined["events"] + step["events"]
        played.append(n)
        rows.append(_step_row(n, step, done, measured, route, profile, lag_bound_ms))
        click.echo(f"  {_brief(rows[-1])}", err=True)
    if route is not None:
        route.stop()

    held = load.call("held", timeout=timeout)
    got: dict[tuple[int, int, str], list[int]] = {}
    for part in _all(followers, "held", timeout=timeout):
        for key, hashes in part.items():
            got.setdefault(key, []).extend(hashes)
    sizes = {(wid, tier): len(hashes) for (wid, _rank, tier), hashes in got.items()}
    want = {(wid, tier): n for wid, tiers in held.items() for tier, n in tiers.items() if n}
    if sizes != want:
        raise click.ClickException(f"the index holds {sum(sizes.values())} blocks, the workers {sum(want.values())}")
    rejected = [r for r in _all(followers, "rejected", timeout=timeout) if r]
    if rejected:
        raise click.ClickException(f"events rejected or skipped: {rejected}")
    followed = [r["workers"] for r in rows if r["followed"] and r["generator_pace"] >= KEEP_UP]
    last = rows[-1]
    return {
        "steps_played": played,
        "steps": rows,
        "workers_followed": max(followed, default=0),
        **{k: last[k] for k in (
            "offered_block_events_per_s", "folded_block_events_per_s", "lag_p99_ms", "route_p99_us", "rss_bytes",
            "blocks_held", "index_bytes_per_block",
        )},
        "events_offered": events_offered,
        "events_folded": sum(m["applied_events"] for m in measured),
        "index_digest": index_digest(got),
        "route_errors": route.errors if route is not None else None,
    }


def _lag_figures(lags: Sequence[float]) -> dict[str, float]:
    # No record in a step (a rate too low to store a request in it): nothing lagged.
    arr = np.asarray(lags) if len(lags) else np.zeros(1)
    return {
        "lag_p50_ms": round(float(np.percentile(arr, 50)), 1),
        "lag_p99_ms": round(float(np.percentile(arr, 99)), 1),
        "lag_max_ms": round(float(arr.max()), 1),
    }


def _step_row(
    n: int, step: dict[str, Any], done: Sequence[float], measured: Sequence[dict[str, Any]], route: RouteClock | None,
    profile: WorkerProfile, lag_bound_ms: float,
) -> dict[str, Any]:
    t0 = step["t0"]
    offered = step["block_events"] / (step["t1"] - t0)
    folded = step["block_events"] / (max(done) - t0)
    target = n * profile.events_per_s
    lags = _lag_figures([lag for m in measured for lag in m["lags_ms"]])
    blocks = sum(m["blocks_held"] for m in measured)
    rss = sum(m["rss_bytes"] for m in measured)
    # The replicas' CPU, less the routes' where they ran in the replica's process: the
    # fold's cost per event, which other jobs on the machine do not inflate.
    cpu_s = sum(m["cpu_s"] for m in measured) - (route.cpu_s(measured[0]["since"], time.time()) if route else 0.0)
    row: dict[str, Any] = {
        "workers": n,
        "target_block_events_per_s": round(target),
        "offered_block_events_per_s": round(offered),
        # Below 1 when the generator could not produce its records in time (restarts
        # alone lower the offered rate below the target: a fresh pool evicts nothing).
        "generator_pace": round(step["played_s"] / (step["t1"] - t0), 3),
        "folded_block_events_per_s": round(folded),
        "block_events": step["block_events"],
        "records": step["records"],
        "restarts": step["restarts"],
        "catch_up_s": round(max(0.0, max(done) - step["t1"]), 3),
        **lags,
        "replica_cpu_s": round(cpu_s, 3),
        "folded_block_events_per_cpu_s": round(step["block_events"] / cpu_s),
        "rss_bytes": rss,
        "blocks_held": blocks,
        "index_bytes_per_block": round(sum(m["index_bytes"] for m in measured) / blocks, 1),
        "rss_bytes_per_block": round(rss / blocks, 1),
        "followed": lags["lag_p99_ms"] <= lag_bound_ms and folded >= KEEP_UP * offered,
    }
    if route is not None:
        routes = route.window(t0, max(done))
        row.update({
            "routes": len(routes),
            "route_p50_us": percentiles_us(routes, 50)[0] if routes else None,
            "route_p99_us": percentiles_us(routes, 99)[0] if routes else None,
        })
    else:
        row["route_p99_us"] = None
    if len(measured) > 1:
        row["by_shard"] = [
            {
                "block_events": events,
                "folded_block_events_per_s": round(events / (at - t0)),
                **_lag_figures(m["lags_ms"]),
                "cpu_s": round(m["cpu_s"], 3),
                "folded_block_events_per_cpu_s": round(events / m["cpu_s"]),
                "blocks_held": m["blocks_held"],
                "rss_bytes": m["rss_bytes"],
            }
            for events, at, m in zip(step["block_events_by_shard"], done, measured)
        ]
    return row


def _brief(row: dict[str, Any]) -> str:
    shards = "".join(
        f"; shard {i}: folded {s['folded_block_events_per_s']:,}/s, lag p99 {s['lag_p99_ms']:,} ms"
        for i, s in enumerate(row.get("by_shard", ()))
    )
    return (
        f"offered {row['offered_block_events_per_s']:,}/s (target {row['target_block_events_per_s']:,}), "
        f"folded {row['folded_block_events_per_s']:,}/s ({row['folded_block_events_per_cpu_s']:,} per replica CPU-s), "
        f"lag p99 {row['lag_p99_ms']:,} ms, "
        f"route p99 {row['route_p99_us']} µs, {'followed' if row['followed'] else 'NOT followed'}{shards}"
    )
