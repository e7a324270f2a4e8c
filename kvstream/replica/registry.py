"""The worker registry: the fold of the compacted ``kvstream.workers`` topic, one
:class:`~kvstream.events.registration.Registration` per worker id (who may win a route;
the gateway's directory of registered workers, kvstream.gateway.static).

The fold keeps the last record of each key, which is exactly what compaction keeps: a
replica that read the whole history and one that started after a compaction hold the
same registry. A record that cannot be applied is counted by reason (``bad_key``: not a
worker id; ``undecodable``; ``invalid``: a registration that breaks a rule;
``wrong_key``: another worker's registration; ``unknown_tombstone``: a tombstone for no
registered worker) and skipped; nothing a record holds can raise out of
:meth:`WorkerRegistry.apply`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from kvstream.events.errors import RegistrationError
from kvstream.events.registration import Registration, RegistrationCodec
from kvstream.events.wire import key_worker


class WorkerRegistry:
    """:meth:`apply` is called by one reader thread; the read methods from any thread
    (they return immutable snapshots swapped under a lock)."""

    def __init__(self, codec: RegistrationCodec | None = None) -> None:
        self._codec = codec if codec is not None else RegistrationCodec()
        self._lock = threading.Lock()
        self._regs: dict[int, Registration] = {}
        self._current: Mapping[int, Registration] = MappingProxyType({})
        self._ids: frozenset[int] = frozenset()
        self.skipped: Counter[str] = Counter()
        self.applied = 0

    def apply(self, key: bytes | None, value: bytes | None) -> str | None:
        """Fold one record; returns None when applied, else the reason it was skipped."""
        reason = self._apply(key, value)
        with self._lock:
            if reason is None:
                self.applied += 1
            else:
                self.skipped[reason] += 1
        return reason

    def _apply(self, key: bytes | None, value: bytes | None) -> str | None:
        wid = key_worker(key)
        if wid is None:
            return "bad_key"
        if value is None:
            with self._lock:
                if wid not in self._regs:
                    # Also what a reader sees of a worker that came and went before a
                    # compaction kept only its tombstone: harmless, counted.
                    return "unknown_tombstone"
                del self._regs[wid]
                self._swap()
            return None
        try:
            reg = self._codec.decode(value)
        except RegistrationError as exc:
            return exc.reason
        if reg.worker_id != wid:
            # Compaction keeps one record per key: a record under another worker's key
            # would replace that worker's registration.
            return "wrong_key"
        with self._lock:
            self._regs[wid] = reg
            self._swap()
        return None

    def _swap(self) -> None:
        self._current = MappingProxyType({wid: self._regs[wid] for wid in sorted(self._regs)})
        self._ids = frozenset(self._regs)

    def worker_ids(self) -> frozenset[int]:
        """Every registered worker's id, routable or not (swapped whole: no lock)."""
        return self._ids

    def registration(self, worker_id: int) -> Registration | None:
        return self._current.get(worker_id)

    def registrations(self) -> Mapping[int, Registration]:
        """Every registered worker, routable or not, in id order: a read-only snapshot,
        the same object until a record changes it (swapped whole: no lock)."""
        return self._current

    def view(self) -> dict[str, Any]:
        with self._lock:
            regs, applied, skipped = self._current, self.applied, dict(self.skipped)
        return {
            "workers": {str(wid): reg.view() for wid, reg in regs.items()},
            "applied": applied,
            "skipped": skipped,
        }
