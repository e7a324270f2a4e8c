"""A replica never dies silently (kvstream.replica.supervisor): a failing thread is
reported, counted and restarted with backoff; one that cannot recover is fatal."""

from __future__ import annotations

import threading
import time

from kvstream.replica.metrics import ReplicaMetrics
from kvstream.replica.supervisor import RestartPolicy, Supervisor


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_failing_critical_thread_is_reported_then_healed_by_progress() -> None:
    stop = threading.Event()
    metrics = ReplicaMetrics()
    sup = Supervisor("t", stop, metrics, RestartPolicy(backoff_s=0.05, max_failures=5))
    runs: list[float] = []
    healthy = threading.Event()

    def loop() -> None:
        runs.append(time.monotonic())
        if len(runs) <= 2:
            raise ConnectionError("broker went away")
        sup.progress("ingest")
        healthy.set()
        stop.wait()

    seen: list[list[str]] = []
    sup.spawn("ingest", loop, critical=True)
    _wait(lambda: len(runs) >= 1 and (seen.append(sup.problems()) or bool(seen[-1])))
    assert "ingest thread failed: ConnectionError: broker went away" in seen[-1][0]
    assert healthy.wait(10)
    assert sup.problems() == [] and sup.fatal is None
    assert metrics.thread_failures.labels(thread="ingest")._value.get() == 2
    # The backoff doubles (the intervals also hold the failure's logging, which varies).
    assert runs[1] - runs[0] >= 0.05 and runs[2] - runs[1] >= 0.1
    stop.set()


def test_a_critical_thread_that_never_recovers_is_fatal() -> None:
    stop = threading.Event()
    metrics = ReplicaMetrics()
    reasons: list[str] = []
    sup = Supervisor("t", stop, metrics, RestartPolicy(backoff_s=0.01, max_failures=3), on_fatal=reasons.append)

    def loop() -> None:
        raise ValueError("poisoned")

    sup.spawn("ingest", loop, critical=True)
    _wait(lambda: bool(reasons))
    assert sup.fatal and "poisoned" in sup.fatal and "3 failures" in sup.fatal
    assert sup.problems()[0].startswith("fatal: ")
    assert metrics.fatal._value.get() == 1
    sup.threads[0].join(5)
    assert not sup.threads[0].is_alive()


def test_a_non_critical_thread_is_retried_without_making_the_replica_unready() -> None:
    stop = threading.Event()
    sup = Supervisor("t", stop, ReplicaMetrics(), RestartPolicy(backoff_s=0.01, max_backoff_s=0.02, max_failures=2))
    runs = []

    def loop() -> None:
        runs.append(1)
        raise RuntimeError("active topic unreachable")

    sup.spawn("active", loop, critical=False)
    _wait(lambda: len(runs) >= 5)
    assert sup.problems() == [] and sup.fatal is None
    stop.set()
