"""Supervision of a replica's threads: a replica never dies silently.

Each thread runs its loop under :meth:`Supervisor.spawn`. When the loop raises (or
returns before the replica stops), the failure is logged with its reason, counted
(``kvstream_thread_failures``), shown on ``/readyz`` and the loop is started again
after a growing backoff. A thread marked critical (one whose failure stops ingest or
readiness) keeps the replica unready until it reports progress again
(:meth:`Supervisor.progress`); after ``max_failures`` failures without progress in
between, the failure is fatal: ``on_fatal`` is called (``kvstream router`` then exits
non-zero, so that the orchestrator sees it) and the replica stays unready for good.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvstream.logs import get_logger
from kvstream.replica.metrics import ReplicaMetrics

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    #: First wait before a restart (s); doubled after each failure, up to ``max_backoff_s``.
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    #: Failures of a critical thread without progress in between that are fatal.
    max_failures: int = 5


class Supervisor:
    def __init__(
        self,
        prefix: str,
        stop: threading.Event,
        metrics: ReplicaMetrics,
        policy: RestartPolicy = RestartPolicy(),
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.prefix = prefix
        self.policy = policy
        self.metrics = metrics
        self._stop = stop
        self._on_fatal = on_fatal
        self._lock = threading.Lock()
        #: Critical thread → why it is down (until it reports progress).
        self._down: dict[str, str] = {}
        self._failures: dict[str, int] = {}
        self.fatal: str | None = None
        self.threads: list[threading.Thread] = []

    def spawn(self, name: str, loop: Callable[[], None], *, critical: bool) -> None:
        t = threading.Thread(
            target=self._run, args=(name, loop, critical), name=f"{self.prefix}-{name}", daemon=True
        )
        self.metrics.thread_up.labels(thread=name).set(1)
        t.start()
        self.threads.append(t)

    def progress(self, name: str) -> None:
        """The thread did useful work: it is healthy again."""
        if name in self._down or self._failures.get(name):
            with self._lock:
                self._down.pop(name, None)
                self._failures[name] = 0

    def problems(self) -> list[str]:
        """Why the replica must not be ready (empty: no supervised reason)."""
        with self._lock:
            out = list(self._down.values())
        if self.fatal is not None:
            out.insert(0, f"fatal: {self.fatal}")
        return out

    def _run(self, name: str, loop: Callable[[], None], critical: bool) -> None:
        while not self._stop.is_set():
            try:
                loop()
                if self._stop.is_set():
                    return
                raise RuntimeError("the loop returned while the replica runs")
            except Exception as exc:  # the point of a supervisor: no thread dies silently
                reason = f"{name} thread failed: {type(exc).__name__}: {exc}"
                log.exception("thread failed", thread=name, reason=reason)
                self.metrics.thread_failures.labels(thread=name).inc()
                self.metrics.thread_up.labels(thread=name).set(0)
                with self._lock:
                    failures = self._failures[name] = self._failures.get(name, 0) + 1
                    if critical:
                        self._down[name] = reason
                if critical and failures >= self.policy.max_failures:
                    self._die(f"{reason} ({failures} failures in a row)")
                    return
            wait = min(self.policy.backoff_s * 2 ** (failures - 1), self.policy.max_backoff_s)
            if self._stop.wait(wait):
                return
            self.metrics.thread_up.labels(thread=name).set(1)
            log.warning("thread restarting", thread=name, after_s=wait)

    def give_up(self, reason: str) -> None:
        """Make the replica give up for a reason no restart of a thread can mend (a
        configuration error seen at run time)."""
        self._die(reason)

    def _die(self, reason: str) -> None:
        self.fatal = reason
        self.metrics.fatal.set(1)
        log.error("replica cannot recover", reason=reason)
        if self._on_fatal is not None:
            self._on_fatal(reason)
