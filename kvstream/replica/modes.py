"""How each worker is routed (issue 33): by its index (``events``: its KV events arrive
within its lease) or by the blocks routed to it alone (``approximate``: a routable worker
that publishes no events, or whose events stopped: its lease ran out and the fold dropped
its blocks, while what was routed to it stays expected until its TTL). When its events
return they win: the resync starts with ``cleared``, which drops the predictions.

:class:`WorkerModes` is stepped under the replica's lock (a thread of its own, about once
a second): it gives each routable worker's ranks their device capacity as the bound of
what they may be expected to hold, drops the predictions of workers that left, expires
old predictions, logs each change of mode and keeps the ``kvstream_worker_mode`` gauge, and
the ``kvstream_worker_role`` gauge of each routable worker's role (issue 34).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client import Gauge

from kvstream.logs import get_logger
from kvstream.roles import Role
from kvstream.router import Router

log = get_logger(__name__)

Mode = Literal["events", "approximate"]
MODES: tuple[Mode, ...] = ("events", "approximate")


@dataclass(frozen=True, slots=True)
class Routable:
    """A worker the gateway may route to (registered with an engine URL, or static)."""

    ranks: tuple[int, ...]
    #: Its engine's device capacity in blocks, when known.
    kv_capacity_blocks: int | None
    #: A value of Role (a static worker's is the TOML's string).
    role: str


class WorkerModes:
    def __init__(
        self,
        router: Router,
        routable: Callable[[], Mapping[int, Routable]],
        indexed: Callable[[], Collection[int]],
        gauge: Gauge,
        role_gauge: Gauge,
        clock: Callable[[], float],
    ) -> None:
        """``routable``: the workers the gateway may route to now; ``indexed``: those
        whose events the fold follows (within their lease)."""
        self._router, self._routable, self._indexed, self._gauge, self._clock = router, routable, indexed, gauge, clock
        self._role_gauge = role_gauge
        self._seen: Mapping[int, Routable] | None = None
        self.modes: dict[int, Mode] = {}

    def step(self) -> None:
        """Under the replica's lock."""
        routable, indexed = self._routable(), self._indexed()
        if routable is not self._seen:
            for wid, w in routable.items():
                if self._seen is None or self._seen.get(wid) != w:
                    self._router.set_expected_capacity(wid, w.ranks, w.kv_capacity_blocks)
                    for r in Role:
                        self._role_gauge.labels(worker=str(wid), role=r.value).set(1 if r == w.role else 0)
            for wid in set(self._seen or ()) - set(routable):
                if wid not in indexed:
                    self._router.forget_expected(wid)
                for r in Role:
                    self._role_gauge.remove(str(wid), r.value)
            self._seen = routable
        self._router.expire_expected(self._clock())
        modes: dict[int, Mode] = {wid: "events" for wid in indexed}
        for wid in routable:
            modes.setdefault(wid, "approximate")
        for wid, mode in modes.items():
            before = self.modes.get(wid)
            if before == mode:
                continue
            if mode == "approximate":
                log.warning(
                    "worker routed by predicted blocks (approximate mode)", worker_id=wid,
                    why="no KV event within its lease" if before == "events" else "it publishes no KV events",
                )
            elif before == "approximate":
                log.info("worker routed by its KV events again", worker_id=wid)
            for m in MODES:
                self._gauge.labels(worker=str(wid), mode=m).set(1 if m == mode else 0)
        for wid in set(self.modes) - set(modes):
            for m in MODES:
                self._gauge.remove(str(wid), m)
        self.modes = modes
