"""The fleet simulation loop: requests arrive in trace order, each is routed by the
policy on the router as the event log left it, and runs on its simulated engine.

Simulated time advances from event to event (arrivals, ends of engine steps). Before
every routing decision the event log is synced, so the router has applied exactly the
events emitted up to that moment; an arrival at the same instant as a step end is
routed first. Nothing depends on wall time, so the decisions are a function of the
requests, the options and the seed, whichever log carries the events.
"""

from __future__ import annotations

import heapq
import itertools
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvstream.events.model import Tier
from kvstream.hashing import block_hashes
from kvstream.router import RouterConfig, SchedulerConfig
from kvstream.tools.simulate.engine import EngineConfig, Job, SimEngine
from kvstream.tools.simulate.errors import SimulationError
from kvstream.tools.simulate.eventlog import EventLog, LogStats
from kvstream.tools.simulate.policies import Policy, make_policy
from kvstream.tools.simulate.trace import Request
from kvstream.worker.consolidator import Consolidator, Mode

#: Active requests are freed by the simulation itself; none may expire on the way.
_NO_EXPIRY_S = 30 * 24 * 3600.0


class SimClock:
    """Simulated time in seconds: the router's clock."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


#: Builds the event log of a run: (router config, router clock, seed) → log.
LogFactory = Callable[[RouterConfig, SimClock, int], EventLog]


@dataclass(frozen=True, slots=True)
class SimOptions:
    workers: int = 8
    policy: str = "kv"
    mode: Mode = Mode.DEDUP
    seed: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.workers <= 0:
            raise SimulationError(f"workers must be positive, got {self.workers}")


@dataclass(frozen=True, slots=True)
class RequestResult:
    request_id: str
    worker: int
    arrival_s: float
    first_token_s: float
    finish_s: float
    input_length: int
    output_length: int
    blocks: int
    #: Prompt blocks found on each tier of the chosen worker (its onboarding).
    hits: dict[Tier, int]
    #: What the router credited to the chosen worker per tier (its view of the events).
    predicted: dict[Tier, int]


@dataclass(frozen=True, slots=True)
class SimResult:
    options: SimOptions
    requests: tuple[RequestResult, ...]
    #: (request id, worker id) in routing order.
    decisions: tuple[tuple[str, int], ...]
    busy_s: tuple[float, ...]
    log: LogStats
    replicas_agree: bool
    wall_s: float


def simulate(
    requests: Sequence[Request],
    options: SimOptions,
    make_log: LogFactory,
    progress: bool = False,
    scratch: Path | None = None,
) -> SimResult:
    """Run ``requests`` through a simulated fleet routed by ``options.policy``."""
    if not requests:
        raise SimulationError("the workload has no request")
    longest = max(requests, key=lambda r: r.input_length)
    if longest.input_length // options.engine.block_size > options.engine.device_blocks:
        # Checked before anything runs: such a request could never be admitted.
        raise SimulationError(
            f"request {longest.request_id} has {longest.input_length} prompt tokens, more than a worker's "
            f"device tier holds ({options.engine.device_blocks} blocks of {options.engine.block_size}; "
            "raise --device-tokens)"
        )
    clock = SimClock()
    bs = options.engine.block_size
    router_config = RouterConfig(block_size=bs, scheduler=options.scheduler, request_ttl_s=_NO_EXPIRY_S)
    policy = make_policy(options.policy, options.seed)
    t0 = time.perf_counter()
    log = make_log(router_config, clock, options.seed)
    engines: list[SimEngine] = []
    with tempfile.TemporaryDirectory(prefix="kvstream-sim-", dir=scratch) as tmp:
        try:
            for w in range(options.workers):
                engines.append(SimEngine(w, options.engine, Consolidator(log.writer(w), options.mode), Path(tmp)))
                # One worker at a time: the router learns them in id order, which is the
                # candidate order its tie-breaks follow.
                log.sync(0)
            with log.routing() as router:
                missing = sorted(set(range(options.workers)) - {k.worker_id for k in router.workers()})
            if missing:
                raise SimulationError(
                    f"the router does not list workers {missing} after their first record (a `cleared` "
                    "that starts their epoch), so no request could reach them"
                )
            results, decisions = _run(requests, options, policy, log, engines, clock, progress)
            agree = log.agree()
            stats = log.stats()
        finally:
            for e in engines:
                e.close()
            log.close()
    return SimResult(options, results, decisions, tuple(e.busy_s for e in engines), stats, agree,
                     time.perf_counter() - t0)


def _run(
    requests: Sequence[Request],
    options: SimOptions,
    policy: Policy,
    log: EventLog,
    engines: list[SimEngine],
    clock: SimClock,
    progress: bool,
) -> tuple[tuple[RequestResult, ...], tuple[tuple[str, int], ...]]:
    bs = options.engine.block_size
    ends: list[tuple[float, int, int]] = []  # (step end, tie-break, worker)
    order = itertools.count()
    done: list[RequestResult] = []
    decisions: list[tuple[str, int]] = []
    predicted: dict[str, dict[Tier, int]] = {}
    n = len(requests)
    i = 0

    def arrival(k: int) -> float:
        return requests[k].arrival_ms / 1000 if k < n else math.inf

    def start(engine: SimEngine, now: float) -> None:
        end = engine.begin_step(now, arrival(i))
        if end is not None:
            heapq.heappush(ends, (end, next(order), engine.worker_id))

    bar = tqdm(total=n, desc=f"simulate {options.policy}", unit="req", disable=not progress, leave=False)
    try:
        while True:
            t_arr, t_end = arrival(i), (ends[0][0] if ends else math.inf)
            if math.isinf(t_arr) and math.isinf(t_end):
                break
            if t_end < t_arr:
                _, _, w = heapq.heappop(ends)
                clock.now_s = t_end
                engine = engines[w]
                step = engine.end_step(t_end)
                with log.routing() as router:
                    for job in step.first_tokens:
                        router.prefill_done(job.request_id)
                    for job in step.finished:
                        router.free(job.request_id)
                for job in step.finished:
                    done.append(_result(job, w, predicted.pop(job.request_id)))
                    bar.update()
                start(engine, t_end)
                continue
            req = requests[i]
            i += 1
            clock.now_s = t_arr
            log.sync(round(t_arr * 1000))
            tokens = req.tokens()
            local, seqs = block_hashes(tokens, bs)
            with log.routing() as router:
                decision = policy.route(router, tokens, req.request_id)
            overlap = decision.chosen.overlap
            predicted[req.request_id] = {
                Tier.DEVICE: overlap.device, Tier.HOST_PINNED: overlap.host_pinned, Tier.DISK: overlap.disk,
            }
            w = decision.worker.worker_id
            decisions.append((req.request_id, w))
            engine = engines[w]
            engine.submit(Job(req.request_id, t_arr, req.input_length, req.output_length, local, seqs))
            if not engine.busy:
                start(engine, t_arr)
    finally:
        bar.close()
    stuck = [e.worker_id for e in engines if e.waiting or e.running]
    if stuck:
        raise SimulationError(f"workers {stuck} still hold requests that can never run (device tier too small?)")
    return tuple(done), tuple(decisions)


def _result(job: Job, worker: int, predicted: dict[Tier, int]) -> RequestResult:
    assert job.first_token_s is not None and job.finish_s is not None
    return RequestResult(
        job.request_id, worker, job.arrival_s, job.first_token_s, job.finish_s, job.input_length,
        job.output_length, len(job.seqs),
        {Tier.DEVICE: job.device_blocks, Tier.HOST_PINNED: job.host_blocks, Tier.DISK: job.disk_blocks},
        predicted,
    )
