"""The static worker directory: ``[[gateway.workers]]`` of the TOML, for fleets whose
workers do not register themselves (kvstream.gateway.seams.WorkerDirectory)."""

from __future__ import annotations

from collections.abc import Sequence

from kvstream.gateway.options import StaticWorker
from kvstream.gateway.seams import WorkerEndpoint


class StaticDirectory:
    """A fixed set of workers."""

    def __init__(self, workers: Sequence[StaticWorker]) -> None:
        self._by_id = {
            w.id: WorkerEndpoint(w.id, w.url.rstrip("/"), tuple(w.models), tuple(w.loras),
                                 dp_ranks=w.dp_ranks, api_key=w.api_key)
            for w in sorted(workers, key=lambda w: w.id)
        }
        self._all = tuple(self._by_id.values())

    def endpoints(self) -> Sequence[WorkerEndpoint]:
        return self._all

    def endpoint(self, worker_id: int) -> WorkerEndpoint | None:
        return self._by_id.get(worker_id)
