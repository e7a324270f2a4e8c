"""The worker directories of the gateway (kvstream.gateway.seams.WorkerDirectory): the
static one, ``[[gateway.workers]]`` of the TOML, for fleets whose workers do not register
themselves; the registered one, the replica's fold of ``kvstream.workers``
(kvstream.replica.registry) seen as endpoints; and the fleet's, which joins the two."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvstream.events.errors import RegistrationError
from kvstream.events.registration import Registration, check_role
from kvstream.gateway.errors import OptionsError
from kvstream.gateway.options import StaticWorker
from kvstream.gateway.seams import WorkerDirectory, WorkerEndpoint
from kvstream.replica.registry import WorkerRegistry
from kvstream.roles import Handoff, Role


class StaticDirectory:
    """A fixed set of workers; OptionsError for one whose role breaks a rule of
    registered workers (kvstream.events.registration.check_role)."""

    def __init__(self, workers: Sequence[StaticWorker]) -> None:
        self._by_id = {w.id: _static_endpoint(w) for w in sorted(workers, key=lambda w: w.id)}
        self._all = tuple(self._by_id.values())

    def endpoints(self) -> Sequence[WorkerEndpoint]:
        return self._all

    def endpoint(self, worker_id: int) -> WorkerEndpoint | None:
        return self._by_id.get(worker_id)


def _static_endpoint(w: StaticWorker) -> WorkerEndpoint:
    role, handoff = Role(w.role), None if w.handoff is None else Handoff(w.handoff)
    try:
        check_role(role, handoff, w.bootstrap_port)
    except RegistrationError as exc:
        raise OptionsError(f"worker {w.id}: {exc}") from None
    return WorkerEndpoint(
        w.id, w.url.rstrip("/"), tuple(w.models), tuple(w.loras), dp_ranks=w.dp_ranks,
        kv_capacity_blocks=w.kv_capacity_blocks, api_key=w.api_key, role=role, handoff=handoff,
        bootstrap_port=w.bootstrap_port,
    )


def endpoint_of(reg: Registration) -> WorkerEndpoint | None:
    """The gateway's view of a registered worker; None when it gave no engine URL."""
    if reg.url is None:
        return None
    return WorkerEndpoint(
        worker_id=reg.worker_id, url=reg.url, models=reg.models, loras=reg.loras,
        block_size=reg.block_size, dp_ranks=len(reg.dp_ranks), engine=reg.engine,
        kv_capacity_blocks=reg.kv_capacity_blocks, role=reg.role, handoff=reg.handoff,
        bootstrap_port=reg.bootstrap_port,
    )


class RegisteredDirectory:
    """The registered workers that gave an engine URL, in id order."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self._registry = registry
        #: The registrations last seen and their endpoints: rebuilt only when the
        #: registry swapped its snapshot (the same sequence back until then).
        self._seen: Mapping[int, Registration] | None = None
        self._all: tuple[WorkerEndpoint, ...] = ()
        self._by_id: dict[int, WorkerEndpoint] = {}

    def _current(self) -> None:
        regs = self._registry.registrations()
        if regs is not self._seen:
            eps = tuple(ep for reg in regs.values() if (ep := endpoint_of(reg)) is not None)
            self._all, self._by_id, self._seen = eps, {ep.worker_id: ep for ep in eps}, regs

    def endpoints(self) -> Sequence[WorkerEndpoint]:
        self._current()
        return self._all

    def endpoint(self, worker_id: int) -> WorkerEndpoint | None:
        self._current()
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
