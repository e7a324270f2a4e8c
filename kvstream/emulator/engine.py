"""The emulated engine's step loop, in the server's asyncio loop: schedule a step, sleep
its cost-model time (divided by ``--speed``), apply it, tell the waiting handlers, publish
the step's KV events. A multi-step decode is cut at the next step boundary when a request
arrives, so that it is admitted when vLLM would admit it. Idle, the loop waits on an
event: no polling."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from kvstream.emulator.blocks import BlockPool, HostTier
from kvstream.emulator.kv_events import KvEventPublisher
from kvstream.emulator.metrics import EngineMetrics
from kvstream.emulator.options import EmulatorOptions
from kvstream.emulator.scheduler import EngineRequest, Scheduler, Step
from kvstream.logs import get_logger

_log = get_logger(__name__)
#: Behind the timeline by more than this (a stalled loop), the next step starts now.
_MAX_LAG_S = 0.05


@dataclass(slots=True, eq=False)
class Ticket:
    """A handler's view of its request: new output tokens as they come, and the end."""

    request: EngineRequest
    #: Streamed requests are woken every step; the others only at the end.
    stream: bool
    pending: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def next_tokens(self) -> int:
        """Output tokens made since the last call (0 once finished and drained)."""
        while not self.pending and not self.request.finished:
            self.changed.clear()
            await self.changed.wait()
        n, self.pending = self.pending, 0
        return n


class Engine:
    """One DP rank: its own scheduler, KV cache, metrics' label set and KV-event sockets."""

    def __init__(self, options: EmulatorOptions, rank: int, engine_id: str) -> None:
        self.options = options
        self.pool = BlockPool(options.num_gpu_blocks, options.block_size)
        self.host = HostTier(options.num_cpu_blocks) if options.num_cpu_blocks else None
        self.scheduler = Scheduler(self.pool, options.cost, self.host)
        self.metrics = EngineMetrics(options.model, rank)
        self.publisher = KvEventPublisher(options.kv_events, rank) if options.kv_events else None
        #: vLLM's KV connector engine id (its ``kv_transfer_config.engine_id``).
        self.engine_id = engine_id
        #: A KV connector (host offloading, or a disaggregated hand-off) counts its hits
        #: in vLLM's external prefix cache series.
        self._connector = self.host is not None or options.role != "both"
        self._tickets: dict[EngineRequest, Ticket] = {}
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0

    def start(self) -> None:
        if self.publisher is not None:
            self.publisher.start()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self.publisher is not None:
            self.publisher.close()

    # -- requests -----------------------------------------------------------------------
    def submit(self, prompt: list[int], max_tokens: int, *, stream: bool, cache_salt: str | None = None,
               request_id: str | None = None, receive_kv: bool = False) -> Ticket:
        req = EngineRequest(request_id or uuid.uuid4().hex, prompt, max_tokens, time.monotonic(), cache_salt,
                            receive_kv)
        self.scheduler.add(req)
        ticket = Ticket(req, stream)
        self._tickets[req] = ticket
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self._arrived.set()
        return ticket

    def abort(self, ticket: Ticket) -> None:
        if not ticket.request.finished:
            self.scheduler.abort(ticket.request)
            # Now, not at the end of the step in flight: a router reading the counters
            # right after a failed leg sees it gone.
            self._gauges()
            _log.info("emulate.abort", request=ticket.request.request_id)
        self._tickets.pop(ticket.request, None)

    @property
    def load(self) -> float:
        """vLLM 0.33's DP balancing score of this rank (DPLBAsyncMPClient, core_client.py):
        waiting + running requests, the waiting weighed up to 3× more as KV usage goes from
        50 % to 100 % (a queue on a full cache drains slowly). vLLM reads the counts from a
        100 ms snapshot and its own in-flight requests; here they are exact."""
        waiting = len(self.scheduler.waiting)
        return waiting + len(self.scheduler.running) + waiting * 6.0 * max(0.0, self.pool.usage - 0.5)

    def reset_prefix_cache(self) -> bool:
        done = self.pool.reset()
        self._publish()
        return done

    # -- the loop -----------------------------------------------------------------------
    async def _run(self) -> None:
        cost, speed = self.options.cost, self.options.speed
        #: When the previous step ended on the cost model's timeline: back-to-back steps
        #: start there, not at the (later) wake-up, so sleep overshoot does not add up.
        timeline: float | None = None
        while True:
            if not self.scheduler.has_work:
                timeline = None
                self._arrived.clear()
                await self._arrived.wait()
                continue
            self._arrived.clear()
            step = self.scheduler.schedule()
            self._gauges()
            now = time.monotonic()
            start = now if timeline is None or now - timeline > _MAX_LAG_S else timeline
            done = step.steps
            end = start + step.ms(cost) / 1000 / speed
            if step.steps > 1:
                try:
                    await asyncio.wait_for(self._arrived.wait(), max(0.0, end - now))
                    done = self._steps_by(step, (time.monotonic() - start) * speed * 1000)
                    end = start + step.ms(cost, done) / 1000 / speed
                    await asyncio.sleep(max(0.0, end - time.monotonic()))
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(max(0.0, end - now))
            timeline = end
            self._finish(step, done)

    def _steps_by(self, step: Step, elapsed_ms: float) -> int:
        """The fewest of a multi-step's steps that reach ``elapsed_ms`` (at least one)."""
        lo, hi = 1, step.steps
        while lo < hi:
            mid = (lo + hi) // 2
            if step.ms(self.options.cost, mid) >= elapsed_ms:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _finish(self, step: Step, steps: int) -> None:
        self.steps += steps
        out = self.scheduler.complete(step, steps)
        now = time.monotonic()
        m = self.metrics
        if out.queried:
            m.prefix_queries.inc(out.queried)
            m.prefix_hits.inc(out.hit)
            if self._connector:
                m.external_queries.inc(out.queried)
                m.external_hits.inc(out.host_hit + out.received)
                m.kv_received.inc(out.received)
        made = 0
        for req, n in out.advanced:
            made += n
            if req.first_token is None:
                req.first_token = now
                m.ttft.observe(now - req.arrival)
                m.prompt_tokens.inc(len(req.prompt))
            ticket = self._tickets.get(req)
            if ticket is not None:
                ticket.pending += n
                if ticket.stream:
                    ticket.changed.set()
        if made:
            m.generation_tokens.inc(made)
        for req in out.finished:
            m.e2e.observe(now - req.arrival)
            m.success_length.inc()
            ticket = self._tickets.pop(req, None)
            if ticket is not None:
                ticket.changed.set()
        self._gauges()
        self._publish()

    def _gauges(self) -> None:
        m = self.metrics
        m.running.set(len(self.scheduler.running))
        m.waiting.set(len(self.scheduler.waiting))
        m.kv_usage.set(self.pool.usage)
        if self.scheduler.preemptions:
            m.preemptions.inc(self.scheduler.preemptions)
            self.scheduler.preemptions = 0

    def _publish(self) -> None:
        # G1's events, then the offloading connector's, as vLLM's scheduler gathers them.
        events = self.pool.take_events()
        if self.host is not None:
            events += self.host.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)
