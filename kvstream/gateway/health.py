"""Which workers may take requests: a circuit breaker per worker, fed by the outcome of
every relayed request (passive health) and by the engines' ``/health`` (active health).

A worker's breaker is *closed* while it works; it *opens* after ``breaker_failures``
failures in a row (a connect error, a timeout or a 5xx before the first byte) or one
failed ``/health``, and the worker leaves the candidates. After ``breaker_cooldown_s`` it
is *half-open*: one trial request may go there (a success closes the breaker, a failure
opens it for another cool-down), and a ``/health`` that answers closes it as well.
Everything runs on the event loop's thread: no lock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from kvstream.gateway.errors import UpstreamError
from kvstream.gateway.metrics import GatewayMetrics
from kvstream.gateway.options import GatewayOptions
from kvstream.gateway.seams import WorkerDirectory
from kvstream.gateway.upstream import UpstreamPool
from kvstream.logs import get_logger

log = get_logger(__name__)


class BreakerState(IntEnum):
    """The values of the ``kvstream_gateway_breaker_state`` gauge."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass(slots=True)
class _Breaker:
    failures: int = 0
    opened_at: float | None = None
    trial: bool = False  # a half-open trial request is in flight


class WorkerHealth:
    """The breakers of the directory's workers."""

    def __init__(self, options: GatewayOptions, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.options, self.metrics, self.clock = options, metrics, clock
        self._breakers: dict[int, _Breaker] = {}

    def state(self, worker_id: int) -> BreakerState:
        b = self._breakers.get(worker_id)
        if b is None or b.opened_at is None:
            return BreakerState.CLOSED
        if self.clock() - b.opened_at >= self.options.breaker_cooldown_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def available(self, worker_id: int) -> bool:
        """Whether a request may go to the worker now."""
        b = self._breakers.get(worker_id)
        if b is None or b.opened_at is None:
            return True
        return not b.trial and self.clock() - b.opened_at >= self.options.breaker_cooldown_s

    def attempt(self, worker_id: int) -> None:
        """A request goes to the worker: a half-open worker's trial is now taken."""
        b = self._breakers.get(worker_id)
        if b is not None and b.opened_at is not None:
            b.trial = True

    def abandoned(self, worker_id: int) -> None:
        """A request ended with no verdict on the worker (the client left): a trial
        it was is given to the next request."""
        b = self._breakers.get(worker_id)
        if b is not None:
            b.trial = False

    def succeeded(self, worker_id: int) -> None:
        b = self._breakers.get(worker_id)
        if b is not None and (b.failures or b.opened_at is not None):
            if b.opened_at is not None:
                log.info("worker breaker closed", worker=worker_id)
            b.failures, b.opened_at, b.trial = 0, None, False
            self._show(worker_id)

    def failed(self, worker_id: int, why: str) -> None:
        b = self._breakers.setdefault(worker_id, _Breaker())
        b.failures += 1
        if b.opened_at is not None or b.failures >= self.options.breaker_failures:
            self._open(worker_id, b, why)

    def probed(self, worker_id: int, ok: bool, why: str = "") -> None:
        """The outcome of one ``/health`` of the worker's engine."""
        if not ok:
            self._open(worker_id, self._breakers.setdefault(worker_id, _Breaker()), why)
        elif self.state(worker_id) is not BreakerState.OPEN:
            self.succeeded(worker_id)

    def _open(self, worker_id: int, b: _Breaker, why: str) -> None:
        if b.opened_at is None:
            self.metrics.breaker_opened.labels(worker=str(worker_id)).inc()
            log.warning("worker breaker opened", worker=worker_id, failures=b.failures, reason=why)
        b.opened_at, b.trial = self.clock(), False
        self._show(worker_id)

    def _show(self, worker_id: int) -> None:
        w = str(worker_id)
        self.metrics.breaker_state.labels(worker=w).set(int(self.state(worker_id)))
        self.metrics.worker_up.labels(worker=w).set(int(self.available(worker_id)))

    def refresh_gauges(self, worker_ids: list[int]) -> None:
        """Cool-downs end with time, not with an event: the gauges are set at each probe round."""
        for wid in worker_ids:
            self._show(wid)

    def retain(self, worker_ids: list[int]) -> None:
        """Forget the breakers of workers that left the directory."""
        for wid in set(self._breakers) - set(worker_ids):
            del self._breakers[wid]


async def probe_loop(
    directory: WorkerDirectory, health: WorkerHealth, upstream: UpstreamPool, options: GatewayOptions
) -> None:
    """Ask every registered engine's ``/health`` each ``health_interval_s``, all at once
    (a slow one delays no other), until cancelled."""

    async def probe(worker_id: int, url: str) -> None:
        resp = None
        try:
            async with asyncio.timeout(options.health_timeout_s):
                resp = await upstream.request(url, b"GET", b"/health", (), read_timeout_s=options.health_timeout_s)
                await resp.read()
            health.probed(worker_id, resp.status == 200, f"/health answered {resp.status}")
        except TimeoutError:
            health.probed(worker_id, False, f"/health failed: no answer within {options.health_timeout_s:g}s")
        except UpstreamError as exc:
            health.probed(worker_id, False, f"/health failed: {type(exc).__name__}: {exc}")
        finally:
            if resp is not None:
                resp.close()

    while True:
        try:
            eps = list(directory.endpoints())
            await asyncio.gather(*(probe(ep.worker_id, ep.url) for ep in eps))
            ids = [ep.worker_id for ep in eps]
            health.retain(ids)
            health.refresh_gauges(ids)
        except Exception as exc:  # noqa: BLE001 (the probes must outlive any one failure)
            log.error("health probe round failed", error=f"{type(exc).__name__}: {exc}")
        await asyncio.sleep(options.health_interval_s)
