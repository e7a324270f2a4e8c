"""The worker directories of the gateway (kvstream.gateway.seams.WorkerDirectory): the
static one, ``[[gateway.workers]]`` of the TOML, for fleets whose workers do not register
themselves, and the fleet's, which joins it with the registry folded from
``kvstream.workers``."""

from __future__ import annotations

from collections.abc import Sequence

from kvstream.gateway.options import StaticWorker
from kvstream.gateway.seams import WorkerDirectory, WorkerEndpoint


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


class FleetDirectory:
    """The static workers and the registered ones; a worker in both is the static entry
    (the operator's word, with its credential, over the worker's announcement)."""

    def __init__(self, static: WorkerDirectory, registered: WorkerDirectory) -> None:
        self._static, self._registered = static, registered
        #: The last join and what it was made of: the same sequence back while neither
        #: side changed (the gateway keeps its candidates per model while it does).
        self._joined: tuple[Sequence[WorkerEndpoint], Sequence[WorkerEndpoint], tuple[WorkerEndpoint, ...]] | None = None

    def endpoints(self) -> Sequence[WorkerEndpoint]:
        static = self._static.endpoints()
        if not static:
            return self._registered.endpoints()
        registered = self._registered.endpoints()
        last = self._joined
        if last is not None and last[0] is static and last[1] is registered:
            return last[2]
        ids = {ep.worker_id for ep in static}
        joined = tuple(sorted([*static, *(ep for ep in registered if ep.worker_id not in ids)], key=lambda ep: ep.worker_id))
        self._joined = (static, registered, joined)
        return joined

    def endpoint(self, worker_id: int) -> WorkerEndpoint | None:
        return self._static.endpoint(worker_id) or self._registered.endpoint(worker_id)
