"""The fields of a routing request (``POST /v1/route``, DESIGN.md §9): their schema and
their decoding, one implementation for the HTTP API and for ``kvstream replay explain``.

A JSON body is decoded and validated in one pass by msgspec, straight into these structs:
a prompt is thousands of ints, and their decoding is most of a request's cost (msgspec
takes about half of pydantic's time). A binary body (``application/octet-stream``) is
the token ids as little-endian u32, checked by the compiled core, with the other fields
as query parameters (:class:`RouteQuery`); per-request weights and multimodal spans need
JSON. Every rejection is an :class:`InvalidRequest` that says where and why.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from kvstream.replica import request_ids
from kvstream.replica.errors import ReplicaError
from kvstream.router.costs import POLICIES
from kvstream.router.scheduler import SchedulerOverrides, config_fields

#: Longest prompt accepted (tokens): bounds the work one request can ask for.
MAX_TOKENS = 1 << 20
#: Multimodal spans accepted per request.
MAX_MM_SPANS = 1024
#: Worker ids and multimodal hashes are u64 (msgspec checks bounds up to int64 only, so
#: the upper bound is checked after decoding).
U64_END = 1 << 64

Token = Annotated[int, Meta(ge=0, lt=1 << 32)]
U64 = Annotated[int, Meta(ge=0)]
Weight = Annotated[float, Meta(ge=0)]
Count = Annotated[int, Meta(ge=0)]
Name = Annotated[str, Meta(max_length=256)]
RequestId = Annotated[str, Meta(pattern=request_ids.PATTERN)]


class InvalidRequest(ReplicaError):
    """A request that does not fit the schema; ``details``: where and why (``loc``, ``msg``)."""

    def __init__(self, details: list[dict[str, str]]) -> None:
        super().__init__("; ".join(f"{d['msg']} at {d['loc']}" if d["loc"] else d["msg"] for d in details))
        self.details = details


def _below_u64(values: Iterable[int], name: str) -> None:
    if any(v >= U64_END for v in values):
        raise ValueError(f"`{name}` must be below 2**64")


#: A per-request field of SchedulerConfig (by its type) as the JSON body carries it.
_WIRE: dict[Any, Any] = {float: Weight, int | None: Count, frozenset[int] | None: list[U64]}


def _check_weights(self: Any) -> None:
    _below_u64(self.allowed_workers or (), "allowed_workers")


#: Per-request overrides of the scheduler's weights and filters (§5): the per-request
#: fields of SchedulerConfig (their one definition) but the policy, which is a field of
#: the request itself.
Weights = msgspec.defstruct(
    "Weights",
    [(f.name, _WIRE[hint] | None, None) for f, hint in config_fields(per_request=True) if f.name != "policy"],
    namespace={"__post_init__": _check_weights},
    forbid_unknown_fields=True,
    frozen=True,
)


class MmSpanBody(Struct, forbid_unknown_fields=True, frozen=True):
    """A multimodal object in the prompt: its hash enters the blocks it overlaps."""

    hash: U64
    offset: Count
    length: Annotated[int, Meta(ge=1)]

    def __post_init__(self) -> None:
        _below_u64((self.hash,), "hash")


class RouteQuery(Struct, forbid_unknown_fields=True, frozen=True):
    """The fields of every route request: a binary body's query parameters."""

    request_id: RequestId | None = None
    lora_name: Name | None = None
    #: Cache salt (Dynamo's cache_namespace): blocks are shared only under the same salt.
    cache_salt: Name | None = None
    query_only: bool = False
    #: Include every candidate's terms of worker_logit in the answer.
    explain: bool = False
    #: The routing policy for this request (default: the replica's ``[router] policy``).
    policy: Literal[POLICIES] | None = None  # type: ignore[valid-type]


class RouteRequest(RouteQuery, frozen=True, kw_only=True):
    """A JSON route body: the prompt, and the fields only JSON carries."""

    token_ids: Annotated[list[Token], Meta(max_length=MAX_TOKENS)]
    mm: Annotated[list[MmSpanBody], Meta(max_length=MAX_MM_SPANS)] = []
    weights: Weights | None = None


_JSON = msgspec.json.Decoder(RouteRequest)


def _invalid(exc: msgspec.MsgspecError) -> InvalidRequest:
    # msgspec says "<why> - at `$.<where>`", or only why (malformed JSON, unknown field).
    msg, _, loc = str(exc).partition(" - at ")
    return InvalidRequest([{"loc": loc.strip("`"), "msg": msg}])


def from_json(raw: bytes) -> RouteRequest:
    """A JSON route body, decoded and validated."""
    try:
        return _JSON.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _invalid(exc) from None


def from_doc(doc: Any) -> RouteRequest:
    """A route body already parsed into Python objects (e.g. from a file)."""
    try:
        return msgspec.convert(doc, RouteRequest)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None


def from_query(params: Iterable[tuple[str, str]]) -> RouteQuery:
    """A binary body's fields from its query parameters (``true``/``false`` or ``1``/``0``
    for flags); a parameter given twice is refused, not one of its values dropped."""
    fields: dict[str, str] = {}
    for key, value in params:
        if key in fields:
            raise InvalidRequest([{"loc": f"$.{key}", "msg": "query parameter given more than once"}])
        fields[key] = value
    try:
        return msgspec.convert(fields, RouteQuery, strict=False)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None


def overrides(req: RouteQuery) -> SchedulerOverrides | None:
    """The scheduler overrides a request asks for (weights, filters, policy), or None."""
    weights = req.weights if isinstance(req, RouteRequest) else None
    if weights is None and req.policy is None:
        return None
    w = msgspec.structs.asdict(weights) if weights is not None else {}
    if w.get("allowed_workers") is not None:
        w["allowed_workers"] = frozenset(w["allowed_workers"])
    return SchedulerOverrides(**w, policy=req.policy)
