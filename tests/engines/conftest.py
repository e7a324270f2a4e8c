"""Fixtures of the engine conformance suite: the engines' own publishers (from their
pinned wheels, tests/engines/engines.py) feeding a kvstream engine worker, through the
real Kafka broker, into a replica that routes."""

from __future__ import annotations

import errno
import itertools
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
from confluent_kafka.admin import AdminClient

from kvstream.hashing import MmSpan, block_hashes
from kvstream.kafka.config import admin_config
from kvstream.kafka.topics import ensure_topics
from kvstream.replica.replica import Replica, ReplicaOptions
from kvstream.router.index import TierOverlap, WorkerKey
from kvstream.settings import Settings, TopicSettings
from kvstream.tools.procs import free_port_run
from kvstream.worker.announce import register_synthetic
from kvstream.worker.consolidator import Mode
from kvstream.worker.engine_node import EngineNode, EngineNodeOptions
from kvstream.worker.publisher import PublisherOptions
from kvstream.worker.zmq_bridge import BridgeOptions, Endpoint, Flavour, Issue

from .engines import EngineKit, kit

WAIT_S = 30.0
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_ids = itertools.count(1_000 + random.randrange(1 << 20) * 1_000)


@pytest.fixture(scope="session", params=["vllm", "sglang"])
def engine(request: pytest.FixtureRequest) -> EngineKit:
    """Each engine's KV-event module, from its pinned wheel (fetched once, cached)."""
    return kit(request.param)


@pytest.fixture(scope="session")
def vllm() -> EngineKit:
    return kit("vllm")


@pytest.fixture(scope="session")
def sglang() -> EngineKit:
    return kit("sglang")


@dataclass
class Env:
    settings: Settings
    replica: Replica


@pytest.fixture(scope="module")
def env(kafka_bootstrap: str) -> Iterator[Env]:
    """This module's topics and one replica that folds every worker of the module."""
    settings = Settings(
        bootstrap=kafka_bootstrap, topics=TopicSettings(prefix=f"test.{uuid.uuid4().hex[:12]}.", events_partitions=2)
    )
    ensure_topics(settings)
    replica = Replica(settings, ReplicaOptions(tick_interval_s=3600.0, resync_min_interval_s=0.5))
    replica.start()
    try:
        assert replica.wait_ready(60), "replica never became ready"
        yield Env(settings, replica)
    finally:
        replica.stop()
        admin = AdminClient(admin_config(settings))
        names = [n for n in admin.list_topics(timeout=30).topics if n.startswith(settings.topics.prefix)]
        for future in admin.delete_topics(names, request_timeout=30).values():
            future.result(timeout=30)


def eventually(fn: Callable[[], Any], expected: Any, timeout: float = WAIT_S) -> None:
    """Wait until ``fn()`` equals ``expected`` (asserting with the last value)."""
    deadline = time.monotonic() + timeout
    last = fn()
    while last != expected and time.monotonic() < deadline:
        time.sleep(0.05)
        last = fn()
    assert last == expected


def tokens(n_blocks: int, start: int = 0, block_size: int = 16) -> list[int]:
    return list(range(start, start + n_blocks * block_size))


class Rig:
    """One worker: ``ranks`` publishers of ``engine`` (its own ZmqEventPublisher, one per
    DP rank, on its own ports) and one kvstream engine worker bridging all of them."""

    def __init__(
        self,
        env: Env,
        engine: EngineKit,
        *,
        ranks: int = 1,
        mode: Mode = Mode.PASSTHROUGH,
        replay: bool = True,
        flavour: Flavour | None = None,
        block_size: int = 16,
        state_dir: Path | None = None,
        publisher_kw: dict[str, Any] | None = None,
    ) -> None:
        self.env = env
        self.engine = engine
        self.worker_id = next(_ids)
        self.ranks = ranks
        self.base = free_port_run(2 * ranks)
        self.replay_base = self.base + ranks if replay else None
        self.publisher_kw = publisher_kw or {}
        self.pubs: list[Any] = []
        self.sent = [0] * ranks
        self.start_engine()
        self.options = EngineNodeOptions(
            PublisherOptions(worker_id=self.worker_id, lease_ms=600_000, heartbeat_s=1.0, linger_ms=2.0),
            BridgeOptions(
                tuple(
                    Endpoint(
                        f"tcp://127.0.0.1:{self.base + r}",
                        f"tcp://127.0.0.1:{self.replay_base + r}" if self.replay_base else None,
                        r,
                    )
                    for r in range(ranks)
                ),
                flavour=flavour or Flavour(engine.name),
                block_size=block_size,
                replay_timeout_ms=5000,
            ),
            mode,
            state_dir,
            checkpoint_s=0.2,
        )
        self.node: EngineNode | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the engine ---------------------------------------------------------------------

    def start_engine(self) -> None:
        """(Re)start the engine's publishers: a new process numbers from 0 again."""
        self.pubs = [self._bind(r) for r in range(self.ranks)]
        self.sent = [0] * self.ranks

    def _bind(self, rank: int) -> Any:
        # ZMQ closes a socket's port asynchronously: a restarted engine may have to wait.
        deadline = time.monotonic() + 10
        while True:
            try:
                return self.engine.publisher(rank, self.base, self.replay_base, **self.publisher_kw)
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop_engine(self) -> None:
        for p in self.pubs:
            p.shutdown()

    def publish(self, *events: Any, rank: int = 0) -> None:
        self.pubs[rank].publish(self.engine.batch(list(events)))
        self.sent[rank] += 1

    def wait_sent(self, rank: int = 0, timeout: float = WAIT_S) -> None:
        """Wait until the engine's publisher thread has sent (and buffered) everything
        published on ``rank``: its replay socket then has the last message."""
        assert self.replay_base is not None
        want = self.sent[rank] - 1
        ctx = zmq.Context.instance()
        deadline = time.monotonic() + timeout
        while True:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            try:
                dealer.connect(f"tcp://127.0.0.1:{self.replay_base + rank}")
                dealer.send_multipart([b"", want.to_bytes(8, "big")])
                seqs = []
                while dealer.poll(5000):
                    frames = dealer.recv_multipart()
                    if frames[2] == END_SEQ:  # the end marker [b"", b"", -1, b""]
                        break
                    seqs.append(int.from_bytes(frames[2], "big"))
            finally:
                dealer.close(linger=0)
            if want in seqs:
                return
            assert time.monotonic() < deadline, f"engine rank {rank} never sent message {want}"
            time.sleep(0.05)

    # -- the worker ---------------------------------------------------------------------

    def start_worker(self) -> EngineNode:
        self.node = EngineNode(self.env.settings, self.options)
        self.node.start()
        self.resume_worker()
        self._register()
        return self.node

    def _register(self) -> None:
        """Registered as `kvstream worker` registers its bridge: routing admits only
        registered workers (kvstream.replica.admission)."""
        registry = self.env.replica.registry
        if registry.registration(self.worker_id) is not None:
            return
        register_synthetic(self.env.settings, [self.worker_id])
        deadline = time.monotonic() + 30
        while registry.registration(self.worker_id) is None:
            assert time.monotonic() < deadline, f"worker {self.worker_id}'s registration never reached the replica"
            time.sleep(0.02)

    def pause_worker(self) -> None:
        """The worker stops reading (its sockets stay connected and fill up)."""
        assert self._thread is not None
        self._stop.set()
        self._thread.join(30)

    def resume_worker(self) -> None:
        assert self.node is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.node.run, args=(self._stop,), daemon=True)
        self._thread.start()

    def stop_worker(self) -> None:
        assert self.node is not None and self._thread is not None
        self._stop.set()
        self._thread.join(30)
        assert self.node.close() == 0
        self.node = None

    def __enter__(self) -> Rig:
        self.start_worker()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.node is not None:
            self.stop_worker()
        self.stop_engine()

    def synced(self, timeout: float = WAIT_S) -> None:
        """Wait until the worker applied everything each publisher sent. A subscriber
        that connects late misses the first messages (ZMQ's slow joiner): an empty
        batch then shows it the sequence, and it replays the rest."""
        assert self.node is not None
        bridge = self.node.bridge
        deadline = time.monotonic() + timeout
        nudged = time.monotonic()
        while True:
            pos = bridge.positions()
            behind = [r for r in range(self.ranks) if pos.get(f"tcp://127.0.0.1:{self.base + r}", (0,))[0] < self.sent[r]]
            if not behind:
                return
            assert time.monotonic() < deadline, f"worker stuck at {pos}, engine sent {self.sent}; {bridge.issues}"
            if time.monotonic() - nudged > 0.5:
                for r in behind:
                    self.publish(rank=r)
                nudged = time.monotonic()
            time.sleep(0.02)

    def problems(self) -> dict[Issue, int]:
        """Engine input issues, less the gaps of ZMQ's slow joiner (the first messages
        a new subscriber misses), which the replay buffer repaired."""
        assert self.node is not None
        issues = dict(self.node.bridge.issues)
        issues.pop(Issue.GAP, None)
        return issues

    # -- the replica --------------------------------------------------------------------

    def overlap(
        self,
        toks: list[int],
        rank: int = 0,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm: tuple[MmSpan, ...] = (),
    ) -> TierOverlap:
        local, seqs = block_hashes(toks, 16, lora_name, cache_salt=cache_salt, mm=mm)
        replica = self.env.replica
        with replica.lock:
            found = replica.router.find_matches_by_tier(local, seqs)
        return found.get(WorkerKey(self.worker_id, rank), TierOverlap())

    def sees(self, toks: list[int], expected: TierOverlap, rank: int = 0, **identity: Any) -> None:
        """The worker must be synced; waits for the replica to fold the log that far."""
        self.synced()
        eventually(lambda: self.overlap(toks, rank, **identity), expected)

    def epoch(self) -> int | None:
        with self.env.replica.lock:
            log = self.env.replica.fold.workers.get(self.worker_id)
        return None if log is None else log.epoch
