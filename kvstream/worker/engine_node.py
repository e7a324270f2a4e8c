"""A worker that bridges a real engine (DESIGN.md §3): its ZMQ KV-event publishers (one
per DP rank) → one consolidator → one Kafka publisher, under one epoch; with a state
store, it survives its own restarts (kvstream.worker.bridge_state).

Single-threaded: :meth:`EngineNode.run` polls the engine sockets and does the
publisher's housekeeping in turn.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvstream.logs import get_logger
from kvstream.settings import Settings
from kvstream.worker.bridge_state import BridgeCheckpoint, BridgeStateStore
from kvstream.worker.consolidator import Consolidator, Mode
from kvstream.worker.errors import PublisherError
from kvstream.worker.options import DEFAULTS
from kvstream.worker.publisher import KafkaPublisher, PublisherOptions
from kvstream.worker.engine_events import Issue
from kvstream.worker.zmq_bridge import BridgeOptions, ZmqEngineBridge

log = get_logger(__name__)

#: Engine input issues that mean a misconfigured engine or lost blocks: shown by the
#: routers' /v1/workers (through the batches' status header), not only in metrics.
REPORTED_ISSUES: tuple[Issue, ...] = (
    Issue.BLOCK_SIZE_MISMATCH,
    Issue.UNKNOWN_MEDIUM,
    Issue.LORA_WITHOUT_NAME,
    Issue.UNRESOLVED_PLACEHOLDER,
    Issue.UNSUPPORTED_IDENTITY,
    Issue.UNRECOVERED,
)

#: How often the loop reports what it did (a worker runs for ever: this is its progress).
STATUS_EVERY_S = 30.0


@dataclass(frozen=True, slots=True)
class EngineNodeOptions:
    publisher: PublisherOptions
    bridge: BridgeOptions
    mode: Mode = DEFAULTS.mode
    #: Where the bridge keeps its state across restarts; None: it starts empty each time.
    state_dir: Path | None = DEFAULTS.state_dir
    #: Checkpoint the state this often (s) when it changed, after a flush that Kafka
    #: acknowledged. Each costs O(blocks held): measured 0.3 s per 100k blocks.
    checkpoint_s: float = DEFAULTS.checkpoint_s


class EngineNode:
    def __init__(self, settings: Settings, options: EngineNodeOptions) -> None:
        self.options = options
        wid, mode = options.publisher.worker_id, options.mode
        self._store = BridgeStateStore(options.state_dir) if options.state_dir is not None else None
        try:
            cp = self._store.load(wid, mode.value) if self._store else None
            self.publisher = KafkaPublisher(settings, options.publisher, resume=cp.resume if cp and cp.clean else None)
        except BaseException:
            if self._store:
                self._store.close()
            raise
        self.consolidator = Consolidator(self.publisher, mode)
        self.bridge = ZmqEngineBridge(options.bridge, self.consolidator, resolver=self.consolidator)
        if cp is not None:
            self.consolidator.load_state(dict(cp.ranks))
            self.bridge.restore(cp.positions, cp.converter)
            if not cp.clean:
                # Events published after the checkpoint may be on the log: the routers
                # get the whole state again under a new epoch.
                self.publisher.resync(self.consolidator, "bridge restarted after a crash")
            log.info(
                "bridge_state_restored",
                worker_id=wid,
                blocks=self.consolidator.block_count(),
                positions=dict(cp.positions),
                same_epoch=cp.clean,
            )
        if self._store:
            self._store.mark_unclean()
        self._next_checkpoint = time.monotonic() + options.checkpoint_s
        self._saved: tuple[int, int, int] | None = None

    def start(self) -> None:
        """Connect to the engines (and replay what they published while we were away)."""
        self.bridge.connect()

    def run(self, stop: threading.Event) -> None:
        """Engine messages in, housekeeping, until ``stop`` is set."""
        publisher, consolidator, bridge = self.publisher, self.consolidator, self.bridge
        next_status = time.monotonic() + STATUS_EVERY_S
        while not stop.is_set():
            # Engine messages wake it at once; else it waits until the publisher has work.
            self.step(math.ceil(publisher.due_in() * 1000))
            now = time.monotonic()
            if now >= next_status:
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

    def step(self, timeout_ms: int) -> None:
        """One round: engine messages, resync when engine history was lost, the
        publisher's housekeeping, a checkpoint when due."""
        self.bridge.poll(timeout_ms, max_messages=256)
        issues = self.bridge.issues
        if any(issues[i] for i in REPORTED_ISSUES):
            self.publisher.status = {i.value: issues[i] for i in REPORTED_ISSUES if issues[i]}
        if self.bridge.resync_reason is not None:
            reason, self.bridge.resync_reason = self.bridge.resync_reason, None
            self.publisher.resync(self.consolidator, reason)
        self.publisher.poll(self.consolidator)
        if self._store is not None and time.monotonic() >= self._next_checkpoint:
            self._next_checkpoint = time.monotonic() + self.options.checkpoint_s
            # Writing the whole state costs O(blocks): only when something changed.
            if self._saved != self._progress():
                self.checkpoint(clean=False)

    def checkpoint(self, clean: bool) -> bool:
        """Flush, and once Kafka acknowledged everything, save the state; False when
        something stayed unacknowledged (no checkpoint then)."""
        if self._store is None:
            return False
        progress = self._progress()
        if self.publisher.flush():
            log.warning("bridge_checkpoint_skipped", reason="unacknowledged batches")
            return False
        self._store.save(
            BridgeCheckpoint(
                worker_id=self.options.publisher.worker_id,
                mode=self.options.mode.value,
                resume=self.publisher.position(),
                positions=self.bridge.positions(),
                clean=clean,
                ranks=self.consolidator.dump_state(),
                converter=self.bridge.converter.dump(),
            )
        )
        self._saved = progress
        return True

    def _progress(self) -> tuple[int, int, int]:
        """What a checkpoint depends on: engine messages taken, epochs started."""
        return self.bridge.stats.messages, sum(self.bridge.issues.values()), self.publisher.stats.resyncs

    def close(self, withdraw: bool = False) -> int:
        """Stop listening, flush, save a clean checkpoint, release everything; returns
        the batches left unacknowledged (then the checkpoint is not clean).

        ``withdraw``: publish that the worker holds nothing any more (a clean stop), but
        only without a state store: with one, the bridge comes back as the same
        incarnation, whose blocks the routers must still hold."""
        self.bridge.close()
        try:
            if withdraw and self._store is None:
                self.publisher.withdraw()
            if self._store is not None:
                try:
                    self.checkpoint(clean=True)
                except PublisherError as exc:  # a fatal producer error: no clean stop
                    log.error("bridge_checkpoint_failed", error=str(exc))
            return self.publisher.close()
        finally:
            if self._store is not None:
                self._store.close()
