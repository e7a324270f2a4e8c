"""Which workers may win a ``POST /v1/route``: the admission rule, one implementation for
the live replica and for ``kvstream replay explain``.

Anyone who can write to ``kvstream.events`` can make up worker ids: a ``cleared`` is
enough for the fold to know a worker, and an unknown worker has no load, so it would win
every uncached prompt. A worker is admitted only when it has a live registration on
``kvstream.workers`` (what ``kvstream worker`` publishes at start and tombstones at a
clean stop) or is one of ``[[gateway.workers]]`` (the operator's word); of those, the
ones the index knows (alive by the log: a silent worker's lease expires) compete. The
rule depends only on the registry's fold and the index, both folds of compacted or
ordered logs, so every replica, and replay folding the registry up to the same time,
computes the same candidates. ``[router] require_registration = false`` turns it off
(every worker the index knows competes, as before), for fleets whose bridges do not
register.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from kvstream.router.errors import NoEligibleWorkerError
from kvstream.router.index import WorkerKey
from kvstream.settings import Settings


class KnownWorkers(Protocol):
    """What the rule reads of the router: the worker ranks its index knows."""

    def workers(self) -> list[WorkerKey]: ...

    def keys_of(self, worker_id: int) -> list[WorkerKey]: ...


@dataclass(frozen=True, slots=True)
class Admission:
    """The rule; ``required=False``: every indexed worker competes."""

    required: bool = True
    #: Worker ids admitted without a registration (``[[gateway.workers]]``).
    static: frozenset[int] = frozenset()

    def candidates(self, index: KnownWorkers, registered: Collection[int]) -> list[WorkerKey] | None:
        """The keys that compete (every rank the index knows of each admitted worker),
        None when the rule is off; NoEligibleWorkerError when no admitted worker is
        known to the index."""
        if not self.required:
            return None
        admitted = self.static.union(registered) if self.static else registered
        keys = [k for wid in sorted(admitted) for k in index.keys_of(wid)]
        if not keys:
            raise NoEligibleWorkerError(
                f"no registered worker is alive in the index ({len(index.workers())} worker ranks known, "
                f"{len(admitted)} workers registered or in [[gateway.workers]]): workers register with "
                "`kvstream worker`; a fleet whose bridges do not register sets [router] require_registration = false"
            )
        return keys


def admission_from_settings(settings: Settings) -> Admission:
    """The rule a replica (and replay, to agree with it) applies."""
    return Admission(settings.router.require_registration, frozenset(w.id for w in settings.gateway.workers))
