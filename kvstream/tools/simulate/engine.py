"""A simulated inference engine over the real tiered pool (DESIGN.md §8).

Bookkeeping is real: a :class:`TieredBlockPool` per worker (G1 device, G2 host, optional
G3 disk) with its eviction, an inline :class:`OffloadEngine` (write-through G1 → G2, the
disk filter for G3) and the :class:`Onboarder`, all reporting to the worker's
consolidator, so that the router sees the store/remove events a real worker would send.
Bytes cost nothing: blocks are 4 bytes (one fp16 K and V value) and prefill never writes
them. Time is simulated with :class:`CostModel`.

Scheduling is continuous batching, one step at a time: a step admits waiting requests
(first come, first served, up to the batch limit and while G1 can hold their prompt),
prefills them whole, and makes one token for every request already decoding.
``step time = Σ admitted (uncached tokens × prefill + onboarded blocks × onboard cost
of their tier) + running × decode``. An admitted request's first token comes at the end
of its step. Steps with nothing to admit are taken several at once up to the next
arrival (identical to taking them one by one). Decode blocks are not stored: the trace
names prompt blocks only.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstream.tools.simulate.errors import SimulationError
from kvstream.worker.layout import BlockLayout
from kvstream.worker.offload import OffloadEngine, OffloadOptions
from kvstream.worker.onboard import Onboarder
from kvstream.worker.pool import NewBlock, PoolOptions, TieredBlockPool
from kvstream.worker.source_events import SourceEventSink


@dataclass(frozen=True, slots=True)
class CostModel:
    """Simulated time, the same for every policy (documented in docs/RESULTS.md)."""

    #: Prefill compute per prompt token not found in any tier.
    prefill_ms_per_token: float = 0.05
    #: Decode step time per running request (one token each).
    decode_ms_per_token: float = 0.3
    #: Bringing KV back into G1 from host memory, and from disk, per token (a block
    #: costs this times the block size): bytes moved, with no compute.
    onboard_host_ms_per_token: float = 0.005
    onboard_disk_ms_per_token: float = 0.025
    #: Requests running at once (decoding, or admitted in the step).
    batch_limit: int = 32

    def __post_init__(self) -> None:
        for name in ("prefill_ms_per_token", "decode_ms_per_token", "onboard_host_ms_per_token",
                     "onboard_disk_ms_per_token"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise SimulationError(f"cost {name} must be a finite number >= 0, got {value}")
        if self.batch_limit <= 0:
            raise SimulationError(f"batch_limit must be positive, got {self.batch_limit}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Per worker: tier capacities in blocks (disk 0: no G3) and the cost model."""

    device_blocks: int = 16384
    host_blocks: int = 65536
    disk_blocks: int = 262144
    block_size: int = 16
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        if self.device_blocks <= 0 or self.host_blocks <= 0 or self.disk_blocks < 0 or self.block_size <= 0:
            raise SimulationError(
                "device and host capacities and block_size must be positive, disk capacity >= 0"
            )


@dataclass(slots=True)
class Job:
    """A request on a worker. Times are simulated seconds."""

    request_id: str
    arrival_s: float
    input_length: int
    output_length: int
    local: list[int]
    seqs: list[int]
    remaining: int = 0
    slots: list[int] = field(default_factory=list)
    device_blocks: int = 0
    host_blocks: int = 0
    disk_blocks: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None


@dataclass(frozen=True, slots=True)
class StepEnd:
    """What a finished step did: requests whose first token came, and finished ones."""

    first_tokens: tuple[Job, ...]
    finished: tuple[Job, ...]


class SimEngine:
    """One simulated worker (dp rank 0)."""

    def __init__(self, worker_id: int, config: EngineConfig, sink: SourceEventSink, scratch: Path) -> None:
        """``scratch``: a directory for the G3 block file."""
        self.worker_id = worker_id
        self.config = config
        self.cost = config.cost
        # One fp16 K and V value per block: the pool's copies move 4 bytes a block.
        layout = BlockLayout(num_layers=1, block_size=1, kv_heads=1, head_dim=1)
        disk = config.disk_blocks or None
        self.pool = TieredBlockPool.create(
            layout,
            config.device_blocks,
            PoolOptions(host_capacity=config.host_blocks, disk_capacity=disk,
                        disk_path=scratch / f"worker-{worker_id}.g3" if disk else None, pin_host=False),
            sink,
            device=torch.device("cpu"),
        )
        self.offload = OffloadEngine(self.pool, OffloadOptions(inline=True))
        self.onboarder = Onboarder(self.pool)
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        #: The step in flight: (end time, admitted jobs, decode steps taken).
        self.step: tuple[float, list[Job], int] | None = None
        #: Simulated seconds spent in steps (for the load imbalance).
        self.busy_s = 0.0

    # -- requests ----------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        if len(job.seqs) > self.config.device_blocks:
            raise SimulationError(
                f"request {job.request_id} needs {len(job.seqs)} blocks, more than the "
                f"{self.config.device_blocks} of a worker's device tier (raise --device-tokens)"
            )
        self.waiting.append(job)

    @property
    def busy(self) -> bool:
        return self.step is not None

    def _fits(self, job: Job) -> bool:
        """G1 can hold the whole prompt now, counting what it already holds."""
        device = self.pool.device
        held = device.match(job.seqs)
        unpinned_held = sum(1 for h in job.seqs[:held] if device.info(h).pins == 0)  # type: ignore[union-attr]
        return device.free_blocks + device.evictable_blocks - unpinned_held >= len(job.seqs) - held

    def _admit(self, job: Job) -> float:
        """Onboard the cached prefix, allocate the rest; returns the job's prefill time."""
        res = self.onboarder.onboard(job.seqs)
        job.device_blocks, job.host_blocks, job.disk_blocks = res.device_blocks, res.host_blocks, res.disk_blocks
        job.slots = self.pool.device.allocate(len(job.seqs) - len(res.block_hashes))
        bs = self.config.block_size
        uncached = job.input_length - len(res.block_hashes) * bs
        c = self.cost
        return (uncached * c.prefill_ms_per_token + res.host_blocks * bs * c.onboard_host_ms_per_token
                + res.disk_blocks * bs * c.onboard_disk_ms_per_token) / 1000

    def begin_step(self, now_s: float, next_arrival_s: float) -> float | None:
        """Start a step at ``now_s`` (admissions happen now); returns its end, or None
        when there is nothing to do. ``next_arrival_s``: when the next request may come."""
        assert self.step is None
        admitted: list[Job] = []
        prefill_s = 0.0
        limit = self.cost.batch_limit
        while self.waiting and len(self.running) + len(admitted) < limit and self._fits(self.waiting[0]):
            job = self.waiting.popleft()
            prefill_s += self._admit(job)
            admitted.append(job)
        if not admitted and not self.running:
            return None
        decode_s = self.cost.decode_ms_per_token * len(self.running) / 1000
        steps = 1
        if not admitted and self.running:
            # Nothing changes until a request finishes or another may arrive.
            until_finish = min(j.remaining for j in self.running)
            if math.isinf(next_arrival_s) or decode_s == 0:
                steps = until_finish
            else:
                steps = max(1, min(until_finish, math.ceil((next_arrival_s - now_s) / decode_s)))
        end = now_s + prefill_s + decode_s * steps
        self.busy_s += end - now_s
        self.step = (end, admitted, steps)
        return end

    def end_step(self, now_s: float) -> StepEnd:
        """Finish the step in flight (``now_s`` is its end): admitted requests store
        their new blocks and get their first token; running ones advance."""
        assert self.step is not None
        _, admitted, steps = self.step
        self.step = None
        finished: list[Job] = []
        still: list[Job] = []
        for job in self.running:
            job.remaining -= steps
            (finished if job.remaining <= 0 else still).append(job)
        device = self.pool.device
        for job in admitted:
            start = len(job.seqs) - len(job.slots)
            if job.slots:
                device.register(
                    [NewBlock(slot, job.seqs[i], job.seqs[i - 1] if i else None, job.local[i])
                     for slot, i in zip(job.slots, range(start, len(job.seqs)))],
                    pin=True,
                )
            job.first_token_s = now_s
            job.remaining = job.output_length - 1
            (finished if job.remaining <= 0 else still).append(job)
        for job in finished:
            job.finish_s = now_s
            device.unpin(job.seqs)
        self.running = still
        return StepEnd(tuple(admitted), tuple(finished))

    def close(self) -> None:
        self.offload.close(drain=True)
        self.pool.close()
