"""The worker registry: workers' registrations on the compacted ``kvstream.workers``
topic, folded into the :class:`~kvstream.gateway.seams.WorkerDirectory` the gateway reads.

A record is keyed by the worker id as ``kvstream.events`` keys it (8 bytes big-endian);
its value is a ``kvstream.workers.WorkerRegistration`` (schemas/), or null, a tombstone,
when the worker left. The fold keeps the last record of each key, which is exactly what
compaction keeps: a replica that read the whole history and one that started after a
compaction hold the same registry. A record that cannot be applied (undecodable, a key
that is not its worker id, a tombstone for no registered worker) is counted by reason and
skipped; nothing a record holds can raise out of :meth:`WorkerRegistry.apply`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvstream.events.codec import AvroCodec
from kvstream.events.errors import EventError
from kvstream.events.model import U64_MAX
from kvstream.events.wire import key_worker, to_long, to_u64
from kvstream.gateway.errors import RegistrationError
from kvstream.gateway.seams import WorkerEndpoint

WORKER_REGISTRATION = "kvstream.workers.WorkerRegistration"
_U32_MAX = (1 << 32) - 1
#: Longest model or adapter name accepted (OpenAI ids are short; this bounds a record).
MAX_NAME_CHARS = 256
MAX_NAMES = 1024


def normalize_url(url: str) -> str:
    """``http(s)://host[:port][/path]`` without a trailing slash; RegistrationError otherwise."""
    if not isinstance(url, str):
        raise RegistrationError(f"engine URL must be a string, got {type(url).__name__}")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RegistrationError(f"engine URL {url[:200]!r} is not http(s)://host[:port]")
    if parts.query or parts.fragment:
        raise RegistrationError(f"engine URL {url[:200]!r} must not carry a query or fragment")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise RegistrationError(f"engine URL {url[:200]!r} has a bad port") from None
    return url.strip().rstrip("/")


def _names(values: Sequence[str], what: str) -> tuple[str, ...]:
    if len(values) > MAX_NAMES:
        raise RegistrationError(f"{len(values)} {what}: at most {MAX_NAMES}")
    out: list[str] = []
    for v in values:
        if not isinstance(v, str) or not v or len(v) > MAX_NAME_CHARS or v != v.strip():
            raise RegistrationError(f"{what} name {str(v)[:80]!r} must be 1..{MAX_NAME_CHARS} characters, unpadded")
        if v not in out:
            out.append(v)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Registration:
    """One worker's registration, as the topic carries it."""

    worker_id: int
    #: None: the worker gave no engine URL; it is in the registry but not routable.
    url: str | None
    models: tuple[str, ...]
    loras: tuple[str, ...]
    block_size: int
    dp_ranks: tuple[int, ...]
    engine: str
    kv_capacity_blocks: int | None
    epoch: int
    registered_at_ms: int

    def __post_init__(self) -> None:
        if not 0 <= self.worker_id <= U64_MAX or not 0 <= self.epoch <= U64_MAX:
            raise RegistrationError("worker_id and epoch must be u64")
        if self.url is not None:
            object.__setattr__(self, "url", normalize_url(self.url))
        object.__setattr__(self, "models", _names(self.models, "model"))
        object.__setattr__(self, "loras", _names(self.loras, "LoRA adapter"))
        if self.block_size < 1:
            raise RegistrationError(f"block_size {self.block_size} must be positive")
        if not self.dp_ranks or len(set(self.dp_ranks)) != len(self.dp_ranks) or not all(
            0 <= r <= _U32_MAX for r in self.dp_ranks
        ):
            raise RegistrationError(f"dp_ranks {list(self.dp_ranks)[:16]} must be distinct u32 values, at least one")
        if not self.engine or len(self.engine) > 64:
            raise RegistrationError("engine kind must be 1..64 characters")
        if self.kv_capacity_blocks is not None and self.kv_capacity_blocks < 0:
            raise RegistrationError(f"kv_capacity_blocks {self.kv_capacity_blocks} is negative")

    def endpoint(self) -> WorkerEndpoint | None:
        """The gateway's view of this worker; None when it has no engine URL."""
        if self.url is None:
            return None
        return WorkerEndpoint(
            worker_id=self.worker_id, url=self.url, models=self.models, loras=self.loras,
            block_size=self.block_size, dp_ranks=len(self.dp_ranks), engine=self.engine,
            kv_capacity_blocks=self.kv_capacity_blocks,
        )

    def view(self) -> dict[str, Any]:
        """JSON-ready, for /v1/workers and ``kvstream replay workers``."""
        return {
            "url": self.url, "models": list(self.models), "loras": list(self.loras),
            "block_size": self.block_size, "dp_ranks": list(self.dp_ranks), "engine": self.engine,
            "kv_capacity_blocks": self.kv_capacity_blocks, "epoch": self.epoch,
            "registered_at_ms": self.registered_at_ms, "routable": self.url is not None,
        }


class RegistrationCodec:
    """:class:`Registration` ↔ single-object Avro bytes of ``WorkerRegistration``."""

    def __init__(self, codec: AvroCodec | None = None) -> None:
        self.codec = codec if codec is not None else AvroCodec()

    def encode(self, reg: Registration) -> bytes:
        return self.codec.encode(
            WORKER_REGISTRATION,
            {
                "worker_id": to_long(reg.worker_id, "worker_id"), "url": reg.url, "models": list(reg.models),
                "loras": list(reg.loras), "block_size": reg.block_size, "dp_ranks": list(reg.dp_ranks),
                "engine": reg.engine, "kv_capacity_blocks": reg.kv_capacity_blocks,
                "epoch": to_long(reg.epoch, "epoch"), "registered_at_ms": reg.registered_at_ms,
            },
        )

    def decode(self, data: bytes) -> Registration:
        """The registration, or RegistrationError (reason ``undecodable`` or ``invalid``)."""
        try:
            name, r = self.codec.decode(data)
        except EventError as exc:
            raise RegistrationError(f"undecodable registration: {exc}", reason="undecodable") from None
        if name != WORKER_REGISTRATION:
            raise RegistrationError(f"expected a {WORKER_REGISTRATION} record, got {name}", reason="undecodable")
        try:
            return Registration(
                worker_id=to_u64(r["worker_id"]), url=r["url"], models=tuple(r["models"]),
                loras=tuple(r["loras"]), block_size=r["block_size"], dp_ranks=tuple(r["dp_ranks"]),
                engine=r["engine"], kv_capacity_blocks=r["kv_capacity_blocks"],
                epoch=to_u64(r["epoch"]), registered_at_ms=r["registered_at_ms"],
            )
        except RegistrationError as exc:
            raise RegistrationError(f"invalid registration: {exc}", reason="invalid") from None


#: Why a record was skipped (the ``reason`` label of kvstream_registry_skipped).
SKIP_REASONS = ("bad_key", "undecodable", "invalid", "wrong_key", "unknown_tombstone")


class WorkerRegistry:
    """The fold of ``kvstream.workers``: a :class:`~kvstream.gateway.seams.WorkerDirectory`.

    :meth:`apply` is called by one reader thread; the read methods from any thread
    (they return immutable snapshots swapped under a lock)."""

    def __init__(self, codec: RegistrationCodec | None = None) -> None:
        self._codec = codec if codec is not None else RegistrationCodec()
        self._lock = threading.Lock()
        self._regs: dict[int, Registration] = {}
        self._endpoints: tuple[WorkerEndpoint, ...] = ()
        self._by_id: dict[int, WorkerEndpoint] = {}
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
                self._rebuild()
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
            self._rebuild()
        return None

    def _rebuild(self) -> None:
        eps = [ep for wid in sorted(self._regs) if (ep := self._regs[wid].endpoint()) is not None]
        self._endpoints = tuple(eps)
        self._by_id = {ep.worker_id: ep for ep in eps}
        self._ids = frozenset(self._regs)

    # -- WorkerDirectory ---------------------------------------------------------------

    def endpoints(self) -> Sequence[WorkerEndpoint]:
        """Every routable registered worker (those with an engine URL), in id order."""
        return self._endpoints

    def endpoint(self, worker_id: int) -> WorkerEndpoint | None:
        return self._by_id.get(worker_id)

    # -- views -------------------------------------------------------------------------

    def worker_ids(self) -> frozenset[int]:
        """Every registered worker's id, routable or not (swapped whole: no lock)."""
        return self._ids

    def registration(self, worker_id: int) -> Registration | None:
        with self._lock:
            return self._regs.get(worker_id)

    def registrations(self) -> dict[int, Registration]:
        """Every registered worker, routable or not."""
        with self._lock:
            return dict(self._regs)

    def view(self) -> dict[str, Any]:
        with self._lock:
            regs, applied, skipped = dict(self._regs), self.applied, dict(self.skipped)
        return {
            "workers": {str(wid): regs[wid].view() for wid in sorted(regs)},
            "applied": applied,
            "skipped": skipped,
        }
