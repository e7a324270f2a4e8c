"""``kvstream_worker_role`` (kvstream.replica.modes) without a broker: 1 for each routable
worker's role, 0 for the others, following the routable workers as they change and gone
with the worker."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from kvstream.replica.modes import Routable, WorkerModes
from kvstream.router import Router


def test_the_role_gauge_follows_the_routable_workers() -> None:
    registry = CollectorRegistry()
    modes = Gauge("kvstream_worker_mode", "", ["worker", "mode"], registry=registry)
    roles = Gauge("kvstream_worker_role", "", ["worker", "role"], registry=registry)
    routable = {1: Routable((0,), None, "both"), 2: Routable((0,), None, "prefill")}
    worker_modes = WorkerModes(Router(), lambda: routable, set, modes, roles, lambda: 0.0)

    def shown() -> dict[tuple[str, str], float]:
        return {(s.labels["worker"], s.labels["role"]): s.value
                for m in registry.collect() if m.name == "kvstream_worker_role" for s in m.samples}

    worker_modes.step()
    assert {k for k, v in shown().items() if v == 1} == {("1", "both"), ("2", "prefill")}
    assert len(shown()) == 6  # every role of each worker: 1 for its own, 0 for the others
    routable = {2: Routable((0,), None, "decode")}  # worker 1 left; worker 2 changed its role
    worker_modes.step()
    assert shown() == {("2", "both"): 0, ("2", "prefill"): 0, ("2", "decode"): 1}
