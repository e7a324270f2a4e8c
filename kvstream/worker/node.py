"""A whole synthetic worker in one object: the tiered pool with its offload engine and
synthetic engine (kvstream.worker.synthetic), reporting through the consolidator to the
Kafka publisher. Used by ``kvstream worker --engine synthetic`` and ``kvstream demo``.

The pool calls the consolidator under its lock (from the caller's thread and from the
offload threads); the publisher's own housekeeping (``poll``: linger, heartbeats,
resync requests) takes the same lock, so the consolidator and the publisher always see
one caller at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvstream.settings import Settings
from kvstream.worker.consolidator import Consolidator, Mode
from kvstream.worker.options import DEFAULTS
from kvstream.worker.layout import BlockLayout
from kvstream.worker.offload import OffloadOptions
from kvstream.worker.pool import PoolOptions
from kvstream.worker.publisher import KafkaPublisher, PublisherOptions
from kvstream.worker.synthetic import PromptResult, SyntheticWorker, SyntheticWorkerOptions


@dataclass(frozen=True, slots=True)
class SyntheticNodeOptions:
    publisher: PublisherOptions
    mode: Mode = DEFAULTS.mode
    #: A small KV layout: the synthetic engine writes real bytes, so keep blocks small.
    layout: BlockLayout = field(default_factory=lambda: BlockLayout(num_layers=2, block_size=16, kv_heads=2, head_dim=16))
    device_blocks: int = 512
    host_blocks: int = 2048
    #: None: no disk tier.
    disk_blocks: int | None = 4096
    disk_dir: Path | None = None
    #: Sightings of a block before it goes on to G3 (OffloadOptions.disk_min_seen).
    disk_min_seen: int = OffloadOptions().disk_min_seen
    device: str | None = None


class SyntheticNode:
    def __init__(self, settings: Settings, options: SyntheticNodeOptions) -> None:
        self.options = options
        self.publisher = KafkaPublisher(settings, options.publisher)
        self.consolidator = Consolidator(self.publisher, options.mode)
        disk = options.disk_blocks is not None
        if disk and options.disk_dir is None:
            raise ValueError("a disk tier needs disk_dir")
        pool = PoolOptions(
            host_capacity=options.host_blocks,
            disk_capacity=options.disk_blocks if disk else None,
            disk_path=(Path(options.disk_dir) / f"worker-{options.publisher.worker_id}.g3") if disk else None,
        )
        try:
            self.worker = SyntheticWorker(
                SyntheticWorkerOptions(
                    options.layout, options.device_blocks, pool, OffloadOptions(disk_min_seen=options.disk_min_seen),
                    options.device,
                ),
                self.consolidator,
            )
        except BaseException:
            self.publisher.close()
            raise

    @property
    def worker_id(self) -> int:
        return self.options.publisher.worker_id

    def run_prompt(self, tokens: Iterable[int]) -> PromptResult:
        result = self.worker.engine.run_prompt(tokens)
        self.poll()
        return result

    def poll(self) -> None:
        with self.worker.pool.locked():
            self.publisher.poll(self.consolidator)

    def close(self, withdraw: bool = False) -> int:
        """Finish offloads, close the pool, (``withdraw``: publish that the worker holds
        nothing any more,) flush; returns batches left unacknowledged."""
        try:
            self.worker.close(drain=True)
            self.poll()
            if withdraw:
                self.publisher.withdraw()
        finally:
            left = self.publisher.close()
        return left
