"""A simulated inference engine over the real tiered pool (DESIGN.md §8).

Bookkeeping is real: a :class:`TieredBlockPool` per worker (G1 device, G2 host, optional
G3 disk) with its eviction, an inline :class:`OffloadEngine` (write-through G1 → G2, the
disk filter for G3) and the :class:`Onboarder`, all reporting to the worker's
consolidator, so that the router sees the store/remove events a real worker would send.
Bytes cost nothing: blocks are 4 bytes (one fp16 K and V value) and prefill never writes
them. Time is simulated with :class:`CostModel`.

Scheduling is continuous batching with chunked prefill, one step at a time, as vLLM and
SGLang schedule: every decoding request makes one token and takes one token of the
step's budget; the rest of the budget goes to prompts being prefilled, first come first
served (a prompt longer than the budget is prefilled over several steps). Waiting
requests are admitted while the budget, the batch limit and G1 allow; admission onboards
the cached prefix. ``step time = max(min step, prefilled tokens × prefill + onboarded
tokens × their tier's cost + decoding × decode + their context tokens × KV read)``. A
request's first token comes at the end of the step that finishes its prefill, when its
prompt blocks are registered on G1. Steps with only decoding are taken several at once,
up to the next arrival (the same times as one by one). Decode blocks are not stored: the
trace names prompt blocks only.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstream.engine_model.costs import CostModel
from kvstream.tools.simulate.errors import SimulationError
from kvstream.worker.layout import BlockLayout
from kvstream.worker.lifecycle import PoolRequest
from kvstream.worker.offload import OffloadEngine, OffloadOptions
from kvstream.worker.onboard import Onboarder
from kvstream.worker.pool import PoolOptions, TieredBlockPool
from kvstream.worker.source_events import SourceEventSink


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Per worker: tier capacities in blocks (disk 0: no G3) and the cost model."""

    device_blocks: int = 16384
    host_blocks: int = 65536
    disk_blocks: int = 262144
    block_size: int = 16
    #: Sightings before a block goes on to G3 (the offload engine's disk filter).
    disk_min_seen: int = OffloadOptions().disk_min_seen
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        if self.device_blocks <= 0 or self.host_blocks <= 0 or self.disk_blocks < 0 or self.block_size <= 0:
            raise SimulationError(
                "device and host capacities and block_size must be positive, disk capacity >= 0"
            )
        if self.disk_min_seen <= 0:
            raise SimulationError(f"disk_min_seen must be positive, got {self.disk_min_seen}")


@dataclass(slots=True)
class Job:
    """A request on a worker. Times are simulated seconds."""

    request_id: str
    arrival_s: float
    input_length: int
    output_length: int
    local: list[int]
    seqs: list[int]
    #: Output tokens still to make (set when the prefill ends).
    remaining: int = 0
    #: Prompt tokens still to prefill (set at admission).
    prefill_left: int = 0
    #: Tokens in the KV of a decoding request (prompt and output so far).
    context: int = 0
    #: Its blocks on the pool (from admission).
    request: PoolRequest | None = None
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
        self.offload = OffloadEngine(self.pool, OffloadOptions(inline=True, disk_min_seen=config.disk_min_seen))
        self.onboarder = Onboarder(self.pool)
        self.waiting: deque[Job] = deque()
        #: Admitted, prompt not fully prefilled yet (first come first served).
        self.prefilling: list[Job] = []
        self.decoding: list[Job] = []
        #: The step in flight: (end time, (job, prefill tokens) chunks, decode steps taken).
        self.step: tuple[float, list[tuple[Job, int]], int] | None = None
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

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def _fits(self, job: Job) -> bool:
        """G1 can hold the whole prompt now, counting what it already holds."""
        device = self.pool.device
        held = device.match(job.seqs)
        unpinned_held = sum(1 for h in job.seqs[:held] if device.info(h).pins == 0)  # type: ignore[union-attr]
        return device.free_blocks + device.evictable_blocks - unpinned_held >= len(job.seqs) - held

    def _admit(self, job: Job) -> float:
        """Onboard the cached prefix, allocate the rest; returns the onboarding time (ms).
        At least the prompt's last token is computed (it makes the first output token)."""
        req = job.request = PoolRequest(self.onboarder, job.local, job.seqs)
        res = req.found
        job.device_blocks, job.host_blocks, job.disk_blocks = res.device_blocks, res.host_blocks, res.disk_blocks
        req.allocate()
        bs = self.config.block_size
        job.prefill_left = max(job.input_length - len(res.block_hashes) * bs, 1)
        c = self.cost
        return (res.host_blocks * bs * c.onboard_host_ms_per_token
                + res.disk_blocks * bs * c.onboard_disk_ms_per_token)

    def begin_step(self, now_s: float, next_arrival_s: float) -> float | None:
        """Start a step at ``now_s`` (admissions happen now); returns its end, or None
        when there is nothing to do. ``next_arrival_s``: when the next request may come."""
        assert self.step is None
        c = self.cost
        budget = c.max_batch_tokens - len(self.decoding)
        chunks: list[tuple[Job, int]] = []
        for job in self.prefilling:
            if budget <= 0:
                break
            take = min(job.prefill_left, budget)
            chunks.append((job, take))
            budget -= take
        onboard_ms = 0.0
        while self.waiting and budget > 0 and self.running < c.batch_limit and self._fits(self.waiting[0]):
            job = self.waiting.popleft()
            onboard_ms += self._admit(job)
            self.prefilling.append(job)
            take = min(job.prefill_left, budget)
            chunks.append((job, take))
            budget -= take
        if not chunks and not self.decoding:
            return None
        running = len(self.decoding)
        context = sum(j.context for j in self.decoding)
        steps = 1
        if chunks:
            step_ms = c.step_ms(sum(take for _, take in chunks), running, context, onboard_ms)
        else:
            # Only decodes: nothing changes until a request finishes or another may arrive.
            until_finish = min(j.remaining for j in self.decoding)
            steps = until_finish
            if not math.isinf(next_arrival_s):
                gap_ms = (next_arrival_s - now_s) * 1000
                lo, hi = 1, until_finish  # the fewest steps that reach the next arrival
                while lo < hi:
                    mid = (lo + hi) // 2
                    if c.decode_steps_ms(mid, running, context) >= gap_ms:
                        hi = mid
                    else:
                        lo = mid + 1
                steps = lo
            step_ms = c.decode_steps_ms(steps, running, context)
        end = now_s + step_ms / 1000
        self.busy_s += end - now_s
        self.step = (end, chunks, steps)
        return end

    def end_step(self, now_s: float) -> StepEnd:
        """Finish the step in flight (``now_s`` is its end): decoding requests advance;
        prompts whose prefill ends store their blocks and get their first token."""
        assert self.step is not None
        _, chunks, steps = self.step
        self.step = None
        finished: list[Job] = []
        still: list[Job] = []
        for job in self.decoding:
            job.remaining -= steps
            job.context += steps
            (finished if job.remaining <= 0 else still).append(job)
        first: list[Job] = []
        for job, take in chunks:
            job.prefill_left -= take
            if job.prefill_left > 0:
                continue
            self.prefilling.remove(job)
            job.request.prefilled()  # type: ignore[union-attr]  # set at admission
            job.first_token_s = now_s
            job.remaining = job.output_length - 1
            job.context = job.input_length + 1
            first.append(job)
            (finished if job.remaining <= 0 else still).append(job)
        for job in finished:
            job.finish_s = now_s
            job.request.release()  # type: ignore[union-attr]  # set at admission
        self.decoding = still
        return StepEnd(tuple(first), tuple(finished))

    def close(self) -> None:
        self.offload.close(drain=True)
        self.pool.close()
