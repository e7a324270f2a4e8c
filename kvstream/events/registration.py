"""A worker's registration, the record of the compacted ``kvstream.workers`` topic, and its
Avro codec: what a worker announces (kvstream.worker.announce) and every replica folds
(kvstream.replica.registry).

A record is keyed by the worker id as ``kvstream.events`` keys it (8 bytes big-endian,
kvstream.events.wire); its value is a ``kvstream.workers.WorkerRegistration`` (schemas/),
or null, a tombstone, when the worker left. A registration that breaks a rule (a URL
that is not ``http(s)://host[:port]``, a padded model name, repeated ranks) cannot be
built, so none can be encoded or decoded: RegistrationError says why.

Version 2 of the record adds the worker's role (issue 34); a v1 record reads as role BOTH.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from kvstream.events.codec import AvroCodec
from kvstream.events.errors import EventError, RegistrationError
from kvstream.events.model import U64_MAX
from kvstream.events.wire import to_long, to_u64
from kvstream.roles import Handoff, Role

WORKER_REGISTRATION = "kvstream.workers.WorkerRegistration"
_U32_MAX = (1 << 32) - 1
_PORT_MAX = 65535
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


def check_role(role: Role, handoff: Handoff | None, bootstrap_port: int | None) -> None:
    """The rules of a worker's role, for registered and static workers alike (the gateway
    can only split a request between engines that agree on a hand-off, and can only point
    a bootstrap decode leg at a prefill engine's known port); RegistrationError says which
    one is broken."""
    if role is Role.BOTH:
        if handoff is not None:
            raise RegistrationError(f"role both takes no handoff, got {handoff}")
    elif handoff is None:
        raise RegistrationError(f"role {role} needs a handoff ({' or '.join(Handoff)})")
    if bootstrap_port is None:
        if role is Role.PREFILL and handoff is Handoff.BOOTSTRAP:
            raise RegistrationError("a prefill worker of handoff bootstrap needs its bootstrap_port")
    elif handoff is not Handoff.BOOTSTRAP:
        raise RegistrationError(f"bootstrap_port goes only with handoff bootstrap, got handoff {handoff}")
    elif not 1 <= bootstrap_port <= _PORT_MAX:
        raise RegistrationError(f"bootstrap_port {bootstrap_port} is not in 1..{_PORT_MAX}")


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
    #: Whole requests, or one leg of a disaggregated one (issue 34), and the hand-off.
    role: Role = Role.BOTH
    handoff: Handoff | None = None
    #: A bootstrap prefill engine's ``--disaggregation-bootstrap-port``.
    bootstrap_port: int | None = None

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
        check_role(self.role, self.handoff, self.bootstrap_port)

    def view(self) -> dict[str, Any]:
        """JSON-ready, for /v1/workers and ``kvstream replay workers``."""
        return {
            "url": self.url, "models": list(self.models), "loras": list(self.loras),
            "block_size": self.block_size, "dp_ranks": list(self.dp_ranks), "engine": self.engine,
            "kv_capacity_blocks": self.kv_capacity_blocks, "epoch": self.epoch,
            "registered_at_ms": self.registered_at_ms, "routable": self.url is not None,
            "role": self.role.value, "handoff": None if self.handoff is None else self.handoff.value,
            "bootstrap_port": self.bootstrap_port,
        }


class RegistrationCodec:
    """:class:`Registration` ↔ single-object Avro bytes of ``WorkerRegistration``
    (its enums' symbols are the upper-case names of Role and Handoff)."""

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
                "role": reg.role.name, "handoff": None if reg.handoff is None else reg.handoff.name,
                "bootstrap_port": reg.bootstrap_port,
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
                # A reader pinned to v1 has no role: the worker's is then v1's, BOTH.
                role=_symbol(Role, r.get("role", Role.BOTH.name)),
                handoff=None if r.get("handoff") is None else _symbol(Handoff, r["handoff"]),
                bootstrap_port=r.get("bootstrap_port"),
            )
        except RegistrationError as exc:
            raise RegistrationError(f"invalid registration: {exc}", reason="invalid") from None


_E = TypeVar("_E", Role, Handoff)


def _symbol(enum: type[_E], symbol: str) -> _E:
    """The member an Avro symbol names; UNKNOWN (a symbol added after this reader) is none."""
    try:
        return enum[symbol]
    except KeyError:
        raise RegistrationError(f"{enum.__name__.lower()} {symbol} is not one this reader knows") from None
