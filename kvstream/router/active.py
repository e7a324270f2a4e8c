"""Active sequences (DESIGN.md §6): the load that routed requests put on each worker.

Every change is a plain frozen operation (``AddRequest``, ``PrefillDone``,
``FreeRequest``) applied by :meth:`ActiveSequences.apply`, so that replicas can share
them (``kvstream.active``) and a replay folds the same ops to the same state. Expiry
compares the ops' timestamps with an injectable clock, so tests and replays are
deterministic. The load is held by the compiled core (``kvstream._native.ActiveCore``,
route.rs), where decisions read it; tests/router/reference_router.py is its reference
model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, overload

from kvstream.events.codec import unpack_u64
from kvstream.router.errors import DuplicateRequestError, UnknownRequestError
from kvstream.router.index import WorkerKey
from kvstream.router.rates import PrefillRates

from kvstream._native import ActiveCore

#: Requests older than this are expired (reference: 300 s).
DEFAULT_TTL_S = 300.0


class PackedHashes(Sequence[int]):
    """Sequence hashes as little-endian u64 bytes, as the compiled core returns them and
    the ``kvstream.active`` record carries them: a routed request's 512 hashes become
    Python ints only when something reads them. Equal to the tuple of its ints (and
    hashes as it), so an op holding either compares the same."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        if len(data) % 8:
            raise ValueError(f"packed hashes of {len(data)} bytes: not a multiple of 8")
        self.data = data

    def __len__(self) -> int:
        return len(self.data) // 8

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...

    def __getitem__(self, i: int | slice) -> int | tuple[int, ...]:
        return unpack_u64(self.data)[i]

    def __iter__(self) -> Iterator[int]:
        return iter(unpack_u64(self.data))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedHashes):
            return self.data == other.data
        return isinstance(other, tuple) and unpack_u64(self.data) == other

    def __hash__(self) -> int:
        return hash(unpack_u64(self.data))

    def __repr__(self) -> str:
        return f"PackedHashes({unpack_u64(self.data)!r})"


@dataclass(frozen=True, slots=True)
class AddRequest:
    """A request routed to ``(worker_id, dp_rank)``."""

    request_id: str
    worker_id: int
    dp_rank: int
    #: Prompt length in tokens.
    isl: int
    #: Tokens credited as cached on the chosen worker (§5 ``cached``); the request's
    #: prefill load is ``max(isl − overlap_tokens, 0)``.
    overlap_tokens: int
    #: Sequence hashes of the prompt's full blocks: a chain, each including its prefix.
    sequence_hashes: tuple[int, ...] | PackedHashes
    #: Seconds (the router's clock) when the request was routed.
    timestamp: float


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """The request produced its first token: its prefill tokens no longer load the worker."""

    request_id: str
    timestamp: float


@dataclass(frozen=True, slots=True)
class FreeRequest:
    """The request finished or was cancelled; ``refuted``: before its prompt was
    computed (it failed, was cancelled or moved to another worker), so that the blocks it
    predicted on its worker are not expected there any more."""

    request_id: str
    timestamp: float
    refuted: bool = False


ActiveOp = AddRequest | PrefillDone | FreeRequest


class Refuted(NamedTuple):
    """What a request freed before its prompt was computed no longer predicts: the
    blocks of its prompt that no other request running on its worker holds."""

    worker: WorkerKey
    #: Their sequence hashes, little-endian u64.
    sequence_hashes: bytes


class WorkerLoad(NamedTuple):
    """A worker's load, as the scheduler reads it."""

    prefill_tokens: int
    decode_blocks: int
    requests: int


def _unknown(request_id: str, what: str) -> UnknownRequestError:
    return UnknownRequestError(
        f"{what} of request {request_id!r}, which is not active "
        "(never routed, already freed or expired)"
    )


class ActiveSequences:
    """Per-worker load from routed requests, held by the compiled core."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.core = ActiveCore(ttl_s)
        #: Prefill throughput per worker, learned from each prompt's own prefill time up
        #: to its prefill_done (the ttft policy's rates; folded from the same ops, so
        #: replicas agree).
        self.rates = PrefillRates()

    def __len__(self) -> int:
        return len(self.core)

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and request_id in self.core

    def apply(self, op: ActiveOp) -> Refuted | None:
        """Apply one operation; a refuted free returns what its request no longer
        predicts. Raises DuplicateRequestError (add of an active id) or
        UnknownRequestError (prefill_done / free of an id that is not active)."""
        core = self.core
        if isinstance(op, AddRequest):
            seqs = op.sequence_hashes
            if not core.add(
                op.request_id, op.worker_id, op.dp_rank, op.isl, op.overlap_tokens,
                seqs.data if isinstance(seqs, PackedHashes) else list(seqs), op.timestamp,
            ):
                raise DuplicateRequestError(f"request {op.request_id!r} is already active")
        elif isinstance(op, PrefillDone):
            found, seen = core.prefill_done(op.request_id, op.timestamp)
            if not found:
                raise _unknown(op.request_id, "prefill_done")
            if seen is not None:  # the first prefill_done: the request's TTFT
                worker_id, dp_rank, tokens, seconds, decode_blocks = seen
                self.rates.observe(WorkerKey(worker_id, dp_rank), tokens, seconds, decode_blocks)
        elif isinstance(op, FreeRequest):
            freed = core.free(op.request_id)
            if freed is None:
                raise _unknown(op.request_id, "free")
            if op.refuted:
                return Refuted(WorkerKey(*freed[0]), freed[1])
        else:
            raise TypeError(f"not an active-sequence operation: {op!r}")
        return None

    def expire(self, now: float | None = None) -> list[str]:
        return self.core.expire(self.clock() if now is None else now)

    def remove_worker(self, worker_id: int) -> list[str]:
        for key in [k for k in self.rates.keys() if k.worker_id == worker_id]:
            self.rates.forget(key)
        return self.core.remove_worker(worker_id)

    def load(self, key: WorkerKey) -> WorkerLoad | None:
        ld = self.core.load(key[0], key[1])
        return None if ld is None else WorkerLoad(*ld)

    def loads_for(
        self, keys: Sequence[WorkerKey], seq_hashes: Sequence[int]
    ) -> list[tuple[bool, int, int, int, int]]:
        return self.core.loads_for(list(keys), list(seq_hashes))
