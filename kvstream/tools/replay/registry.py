"""The worker registry as of time T, for ``replay explain``: ``kvstream.workers`` read
up to the first record stamped after T and folded by the replica's own
:class:`~kvstream.replica.registry.WorkerRegistry`, so that the candidates of a replayed
decision follow the live rule (kvstream.replica.admission).

The topic is compacted: a worker that registered before T and registered again after
it (a restart) keeps only its later record, so replay counts it as unregistered at T;
that is said in the notes when it matters (the worker held blocks at T).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstream.events.wire import key_worker
from kvstream.replica.registry import WorkerRegistry
from kvstream.settings import Settings
from kvstream.tools.replay.errors import TopicMissingError
from kvstream.tools.replay.reader import LogReader


@dataclass(frozen=True, slots=True)
class RegistryAt:
    #: Workers with a live registration at T.
    registered: frozenset[int]
    #: Workers whose newest surviving record is after T (compaction may hide one at T).
    later: frozenset[int]
    note: str


def registry_at(settings: Settings, at_ms: int, progress: bool | None = None) -> RegistryAt:
    """The registry as a replica that had read ``kvstream.workers`` up to ``at_ms`` held it."""
    registry = WorkerRegistry()
    later: set[int] = set()
    try:
        with LogReader(settings, "workers") as reader:
            end = reader.offsets_after(at_ms)
            # One pass over the (small) topic: the prefix up to T is folded, the rest noted.
            for rec in reader.read(dict(reader.low), dict(reader.high), progress=progress, desc="workers"):
                if rec.offset < end[rec.partition]:
                    registry.apply(rec.key, rec.value)
                elif (wid := key_worker(rec.key)) is not None:
                    later.add(wid)
    except TopicMissingError:
        return RegistryAt(frozenset(), frozenset(), "no worker registry topic: no worker registered")
    ids = registry.worker_ids()
    return RegistryAt(ids, frozenset(later - ids), f"{len(ids)} workers registered at that time")
