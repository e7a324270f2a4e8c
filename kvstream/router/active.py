"""Active sequences (DESIGN.md §6): the load that routed requests put on each worker.

Every change is a plain frozen operation (``AddRequest``, ``PrefillDone``,
``FreeRequest``) applied by :meth:`ActiveSequences.apply`, so that replicas can share
them (``kvstream.active``) and a replay folds the same ops to the same state. Expiry
compares the ops' timestamps with an injectable clock, so tests and replays are
deterministic.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, overload

from kvstream.events.codec import unpack_u64
from kvstream.router.errors import DuplicateRequestError, UnknownRequestError
from kvstream.router.index import WorkerKey
from kvstream.router.policy import PrefillRates

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
    """The request finished or was cancelled."""

    request_id: str
    timestamp: float


ActiveOp = AddRequest | PrefillDone | FreeRequest


class WorkerLoad(NamedTuple):
    """A worker's load, as the scheduler reads it."""

    prefill_tokens: int
    decode_blocks: int
    requests: int


class _Request:
    __slots__ = ("request_id", "key", "prefill_tokens", "hashes", "serial", "ahead", "decode_blocks", "added_s")

    def __init__(
        self,
        request_id: str,
        key: WorkerKey,
        prefill_tokens: int,
        hashes: Sequence[int],
        serial: int,
        ahead: int,
        decode_blocks: int,
        added_s: float | None,
    ) -> None:
        self.request_id = request_id
        self.key = key
        self.prefill_tokens = prefill_tokens
        self.hashes = hashes
        self.serial = serial
        #: Prefill tokens queued on the worker when this request was routed.
        self.ahead = ahead
        #: Active decode blocks of the worker when this request was routed.
        self.decode_blocks = decode_blocks
        self.added_s = added_s


class _Load:
    __slots__ = ("prefill_tokens", "blocks", "requests")

    def __init__(self) -> None:
        self.prefill_tokens = 0
        #: sequence hash → running requests holding it (shared blocks counted once); a
        #: Counter because its update() counts a whole chain in C.
        self.blocks: Counter[int] = Counter()
        self.requests = 0


class ActiveSequences:
    """Per-worker load from routed requests, folded from :data:`ActiveOp` operations."""

    def __init__(
        self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self.ttl_s = ttl_s
        self.clock = clock
        #: Prefill throughput per worker, learned from route → prefill_done times (the
        #: ttft policy's rates; folded from the same ops, so replicas agree).
        self.rates = PrefillRates()
        self._requests: dict[str, _Request] = {}
        self._loads: dict[WorkerKey, _Load] = {}
        # (timestamp, serial, request id); entries of freed requests are skipped lazily.
        self._expiry: list[tuple[float, int, str]] = []
        self._serial = itertools.count()

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def apply(self, op: ActiveOp) -> None:
        """Apply one operation. Raises DuplicateRequestError (add of an active id) or
        UnknownRequestError (prefill_done / free of an id that is not active)."""
        if isinstance(op, AddRequest):
            self._add(op)
        elif isinstance(op, PrefillDone):
            req = self._get(op.request_id, "prefill_done")
            if req.added_s is not None:  # the first prefill_done: the request's TTFT
                self.rates.observe(
                    req.key, req.ahead + req.prefill_tokens, op.timestamp - req.added_s, req.decode_blocks
                )
                req.added_s = None
            if req.prefill_tokens:
                self._loads[req.key].prefill_tokens -= req.prefill_tokens
                req.prefill_tokens = 0
        elif isinstance(op, FreeRequest):
            self._free(self._get(op.request_id, "free"))
        else:
            raise TypeError(f"not an active-sequence operation: {op!r}")

    def _get(self, request_id: str, what: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(
                f"{what} of request {request_id!r}, which is not active "
                "(never routed, already freed or expired)"
            )
        return req

    def _add(self, op: AddRequest) -> None:
        if op.request_id in self._requests:
            raise DuplicateRequestError(f"request {op.request_id!r} is already active")
        key = WorkerKey(op.worker_id, op.dp_rank)
        load = self._loads.get(key)
        if load is None:
            load = self._loads[key] = _Load()
        prefill = max(op.isl - op.overlap_tokens, 0)
        req = _Request(
            op.request_id, key, prefill, op.sequence_hashes, next(self._serial), load.prefill_tokens,
            len(load.blocks), op.timestamp,
        )
        self._requests[op.request_id] = req
        load.prefill_tokens += prefill
        load.requests += 1
        load.blocks.update(op.sequence_hashes)
        heapq.heappush(self._expiry, (op.timestamp, req.serial, op.request_id))

    def _free(self, req: _Request) -> None:
        del self._requests[req.request_id]
        load = self._loads[req.key]
        load.prefill_tokens -= req.prefill_tokens
        load.requests -= 1
        if not load.requests:
            del self._loads[req.key]  # its blocks go with it
            return
        blocks = load.blocks
        pop = blocks.pop  # dict's (Counter's `del` is a slow Python method)
        for h in req.hashes:
            c = blocks[h]
            if c == 1:
                pop(h)
            else:
                blocks[h] = c - 1

    def expire(self, now: float | None = None) -> list[str]:
        """Free the requests routed more than ``ttl_s`` before ``now`` (default: the
        clock); returns their ids."""
        now = self.clock() if now is None else now
        heap = self._expiry
        out = []
        while heap and now - heap[0][0] > self.ttl_s:
            _, serial, rid = heapq.heappop(heap)
            req = self._requests.get(rid)
            if req is not None and req.serial == serial:
                self._free(req)
                out.append(rid)
        return out

    def remove_worker(self, worker_id: int) -> list[str]:
        """Drop the requests running on any rank of a worker; returns their ids."""
        gone = [rid for rid, r in self._requests.items() if r.key.worker_id == worker_id]
        for rid in gone:
            self._free(self._requests[rid])
        for key in [k for k in self.rates.keys() if k.worker_id == worker_id]:
            self.rates.forget(key)
        return gone

    def load(self, key: WorkerKey) -> WorkerLoad | None:
        """The worker's load, or None when it has no active request (no load entry)."""
        ld = self._loads.get(key)
        if ld is None:
            return None
        return WorkerLoad(ld.prefill_tokens, len(ld.blocks), ld.requests)

    def worker_of(self, request_id: str) -> WorkerKey | None:
        req = self._requests.get(request_id)
        return req.key if req is not None else None

    def loads_for(
        self, keys: Sequence[WorkerKey], seq_hashes: Sequence[int]
    ) -> list[tuple[bool, int, int, int, int]]:
        """Per key: (has load entry, prefill tokens, decode blocks, requests, new blocks
        of ``seq_hashes``), in one pass (the router asks this for every candidate)."""
        n = len(seq_hashes)
        idle = (False, 0, 0, 0, n)
        get = self._loads.get
        held = _held_prefix
        out = []
        for key in keys:
            ld = get(key)
            if ld is None:
                out.append(idle)
            else:
                blocks = ld.blocks
                out.append(
                    (True, ld.prefill_tokens, len(blocks), ld.requests, n - held(blocks, seq_hashes))
                )
        return out

    def new_blocks(self, key: WorkerKey, seq_hashes: Sequence[int]) -> int:
        """How many of ``seq_hashes`` (a prompt's chain) the worker does not hold yet."""
        ld = self._loads.get(key)
        return len(seq_hashes) - (_held_prefix(ld.blocks, seq_hashes) if ld else 0)


def _held_prefix(blocks: dict[int, int], seq_hashes: Sequence[int]) -> int:
    """Length of the prefix of ``seq_hashes`` in ``blocks``. The blocks of running
    requests are prefix-closed (each request holds its whole chain), so the held part
    of a chain is a prefix: found by bisection."""
    n = len(seq_hashes)
    if n == 0 or seq_hashes[0] not in blocks:
        return 0
    if seq_hashes[-1] in blocks:
        return n
    lo, hi = 1, n - 1  # seq_hashes[lo - 1] is held, seq_hashes[hi] is not
    while lo < hi:
        mid = (lo + hi) // 2
        if seq_hashes[mid] in blocks:
            lo = mid + 1
        else:
            hi = mid
    return lo
