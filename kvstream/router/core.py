"""The kv decision in the compiled core (kvstream/_native_src/src/route.rs): the seam.

``CoreActiveSequences`` is :class:`~kvstream.router.active.ActiveSequences`' interface over
the core's active-sequence load, and :func:`decide` makes one routing decision in one
call: hashing, matching across tiers, the load, ``worker_logit`` and the choice (and the
add of a tracked request), with the GIL released while it works. The Python
``ActiveSequences`` and ``Scheduler`` stay the reference model; the property tests
(tests/router/test_core_properties.py) check this against them: same candidates, same
logit terms bit for bit, same choice for the same seed (the uniform draw is taken from
the scheduler's seeded ``random.Random`` here and handed to the core).

Like the rest of the router, this is not for concurrent use: callers serialize access
(the replica holds its router lock around every call). While the GIL is released the
decision holds pyo3 borrows of the index and load cores, so an unserialized writer gets
pyo3's "already borrowed" RuntimeError, never a torn state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from kvstream.hashing import lora_seed
from kvstream.router.active import (
    DEFAULT_TTL_S,
    ActiveOp,
    AddRequest,
    FreeRequest,
    PackedHashes,
    PrefillDone,
    WorkerLoad,
)
from kvstream.router.errors import (
    DuplicateRequestError,
    NoEligibleWorkerError,
    UnknownRequestError,
)
from kvstream.router.index import TieredIndex, WorkerKey
from kvstream.router.policy import PrefillRates
from kvstream.router.scheduler import (
    Candidates,
    LogitColumns,
    Schedule,
    Scheduler,
    SchedulerConfig,
    exclusion,
)

from kvstream._native import ActiveCore

#: A prompt: a list of ints, a buffer of native u32 (numpy uint32, array('I')), or
#: packed little-endian u32 bytes (bytes / bytearray / memoryview, e.g. an HTTP body).
PromptTokens = Sequence[int] | bytes | bytearray | memoryview | np.ndarray


def _unknown(request_id: str, what: str) -> UnknownRequestError:
    return UnknownRequestError(
        f"{what} of request {request_id!r}, which is not active "
        "(never routed, already freed or expired)"
    )


class CoreActiveSequences:
    """Per-worker load from routed requests, held by the compiled core."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.core = ActiveCore(ttl_s)
        #: Prefill throughput per worker (the ttft policy's), as ActiveSequences.rates.
        self.rates = PrefillRates()

    def __len__(self) -> int:
        return len(self.core)

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and request_id in self.core

    def apply(self, op: ActiveOp) -> None:
        """Apply one operation (same errors as ActiveSequences.apply)."""
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
            if not core.free(op.request_id):
                raise _unknown(op.request_id, "free")
        else:
            raise TypeError(f"not an active-sequence operation: {op!r}")

    def expire(self, now: float | None = None) -> list[str]:
        return self.core.expire(self.clock() if now is None else now)

    def remove_worker(self, worker_id: int) -> list[str]:
        for key in [k for k in self.rates.keys() if k.worker_id == worker_id]:
            self.rates.forget(key)
        return self.core.remove_worker(worker_id)

    def load(self, key: WorkerKey) -> WorkerLoad | None:
        ld = self.core.load(key[0], key[1])
        return None if ld is None else WorkerLoad(*ld)

    def worker_of(self, request_id: str) -> WorkerKey | None:
        key = self.core.worker_of(request_id)
        return None if key is None else WorkerKey(*key)

    def loads_for(
        self, keys: Sequence[WorkerKey], seq_hashes: Sequence[int]
    ) -> list[tuple[bool, int, int, int, int]]:
        return self.core.loads_for(list(keys), list(seq_hashes))

    def new_blocks(self, key: WorkerKey, seq_hashes: Sequence[int]) -> int:
        return self.loads_for([key], seq_hashes)[0][4]


def decide(
    index: TieredIndex,
    active: CoreActiveSequences,
    scheduler: Scheduler,
    cfg: SchedulerConfig,
    block_size: int,
    tokens: PromptTokens,
    lora_name: str | None,
    request_id: str | None,
    now: float,
    max_tokens: int | None = None,
    candidates: Sequence[WorkerKey] | None = None,
) -> tuple[Schedule, PackedHashes | None, int]:
    """One kv decision in the core: (schedule, the prompt's sequence hashes when the
    request was added as ``request_id``, prompt length in tokens). ``candidates`` as
    in Router.find_best_match (None: every worker the index knows).

    Raises NoEligibleWorkerError (saying why), DuplicateRequestError, ValueError (bad
    token ids or a binary body that is not whole u32s).
    """
    if request_id is not None and request_id in active.core:
        raise DuplicateRequestError(f"request {request_id!r} is already active")
    if candidates is None:
        slots = index._keys  # noqa: SLF001 (per slot: its key, or None)
        keys = index.workers()
        if not keys:
            raise NoEligibleWorkerError("no workers known: none has published an event within its lease")
    else:
        slots = index.candidate_slots(candidates)
        keys = [k for k in slots if k is not None]
        if not keys:
            raise NoEligibleWorkerError("no candidate worker was given")
    allowed = cfg.allowed_workers
    chosen, ov, ld, cols, probs, seqs, isl = active.core.route(
        index._core,  # noqa: SLF001 (the seam between the two core objects)
        slots,
        tokens,
        block_size,
        lora_seed(lora_name),
        (
            cfg.overlap_score_credit,
            cfg.host_cache_hit_weight,
            cfg.disk_cache_hit_weight,
            cfg.prefill_load_scale,
            cfg.decode_active_request_weight,
            cfg.router_temperature,
        ),
        (
            cfg.max_active_decode_blocks,
            cfg.max_active_prefill_tokens,
            None if allowed is None else list(allowed),
        ),
        scheduler.rng.random(),
        now,
        request_id,
        max_tokens if max_tokens is not None else 2**63,
    )
    n = len(keys)
    c = np.frombuffer(cols, "<f8").reshape(7, n)
    candidates = Candidates(
        tuple(keys),
        np.frombuffer(ov, "<i8").reshape(n, 4),
        np.frombuffer(ld, "<i8").reshape(n, 5),
    )
    columns = LogitColumns(c[0], c[1], c[2], c[3], c[4].astype(np.int64), c[5], c[6])
    filtered = allowed is not None or cfg.max_active_decode_blocks is not None or cfg.max_active_prefill_tokens is not None
    if filtered:
        excluded = tuple(exclusion(cfg, candidates[i]) for i in range(n))
    else:
        excluded = (None,) * n
    if chosen is None:
        # The reference explains why none is eligible (the same filters).
        Scheduler(cfg).schedule(isl, block_size, candidates)
        raise NoEligibleWorkerError("no candidate is eligible")  # the reference raised
    schedule = Schedule(
        candidates, columns, tuple(np.frombuffer(probs, "<f8").tolist()), excluded, chosen, cfg
    )
    return schedule, (PackedHashes(seqs) if seqs is not None else None), isl

