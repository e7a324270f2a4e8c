"""A plain Python model of the routing decision (DESIGN.md §5, §6), for property tests:
the active sequences (dicts and Counters), the §5 terms and the policies' costs (numpy
columns), the filters with their reasons, the selection, and a router that puts them
together as the production one did before the decision moved into the compiled core
(kvstream/_native_src/src/route.rs). tests/router/test_core_properties.py checks the
core against it bit for bit; tests/router/reference.py is the index's model.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import numpy as np

from kvstream.events.model import RouterEvent
from kvstream.hashing import MmSpan, block_hashes
from kvstream.router.active import DEFAULT_TTL_S, ActiveOp, AddRequest, FreeRequest, PrefillDone, WorkerLoad
from kvstream.router.errors import DuplicateRequestError, NoEligibleWorkerError, UnknownRequestError
from kvstream.router.index import TierOverlap, TieredIndex, WorkerKey
from kvstream.router.rates import PrefillRates
from kvstream.router.router import LearnedRates, RouteDecision, RouterConfig
from kvstream.router.scheduler import Candidates as CoreCandidates
from kvstream.router.scheduler import (
    Candidate,
    LogitColumns,
    LogitTerms,
    Schedule,
    SchedulerConfig,
    SchedulerOverrides,
)



@dataclass(frozen=True, slots=True)
class Candidates(CoreCandidates):
    """The candidates with the ttft cost's learned inputs (the core gets them apart)."""

    #: (n,): learned prefill tokens/s per candidate (None: the prior).
    rates: np.ndarray | None = None
    #: Learned prefill slowdown per active decode block (seconds per token).
    decode_slowdown_s: float = 0.0
    #: Per candidate, its prefill queue (_Load.queue's (added, tokens)) and the latest
    #: first token at its head (None: no load entry).
    queues: tuple[tuple[float, tuple[tuple[float, int], ...]] | None, ...] = ()
    #: When the decision is made (the queues drain until then).
    now: float = 0.0
    #: The learned model's relative error (PrefillRates.error).
    rate_error: float = 0.0

    @classmethod
    def from_rows(cls, rows: Sequence[Candidate]) -> Candidates:
        """Candidates as rows say them: each one's prefill tokens queued just now (at 0)."""
        n = len(rows)
        return cls(
            tuple(c[0] for c in rows),
            np.array([c[1] for c in rows], dtype=np.int64).reshape(n, 5),
            np.array([c[2:] for c in rows], dtype=np.int64).reshape(n, 5),
            queues=tuple((-math.inf, ((0.0, c.active_prefill_tokens),) if c.active_prefill_tokens else ()) for c in rows),
        )


# -- active sequences (§6) -----------------------------------------------------------

class _Request:
    __slots__ = ("request_id", "key", "prefill_tokens", "hashes", "serial", "decode_blocks", "added_s")

    def __init__(
        self,
        request_id: str,
        key: WorkerKey,
        prefill_tokens: int,
        hashes: Sequence[int],
        serial: int,
        decode_blocks: int,
        added_s: float | None,
    ) -> None:
        self.request_id = request_id
        self.key = key
        self.prefill_tokens = prefill_tokens
        self.hashes = hashes
        self.serial = serial
        #: Active decode blocks of the worker when this request was routed.
        self.decode_blocks = decode_blocks
        self.added_s = added_s


class _Load:
    __slots__ = ("prefill_tokens", "blocks", "requests", "queue", "last_done")

    def __init__(self) -> None:
        self.prefill_tokens = 0
        #: sequence hash → running requests holding it (shared blocks counted once); a
        #: Counter because its update() counts a whole chain in C.
        self.blocks: Counter[int] = Counter()
        self.requests = 0
        #: serial → (added, prefill tokens) of the requests not past their first token,
        #: in the order they were added (first come, first served).
        self.queue: dict[int, tuple[float, int]] = {}
        #: The latest first token of a request at the queue's head.
        self.last_done = -math.inf


def queued(last_done: float, queue: Sequence[tuple[float, int]], now: float, per_token: float) -> float:
    """The prefill tokens still queued at ``now``: the head's prompt less what it
    computed at ``per_token`` seconds a token since it could start (its add, or the latest
    first token before it), and the whole prompts behind it."""
    if not queue:
        return 0.0
    (added, head), behind = queue[0], sum(tokens for _, tokens in queue[1:])
    start = max(added, last_done)
    return max(head - max(now - start, 0.0) / per_token, 0.0) + behind


class ActiveSequences:
    """Per-worker load from routed requests, folded from :data:`ActiveOp` operations."""

    def __init__(
        self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self.ttl_s = ttl_s
        self.clock = clock
        #: Prefill throughput per worker, learned from each prompt's own prefill time up
        #: to its prefill_done (the ttft policy's rates; folded from the same ops, so
        #: replicas agree).
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
            load = self._loads[req.key]
            if req.added_s is not None:  # the first prefill_done: its own prefill's time
                start = max(req.added_s, load.last_done)
                if not load.queue or next(iter(load.queue)) == req.serial:
                    load.last_done = max(load.last_done, op.timestamp)
                self.rates.observe(req.key, req.prefill_tokens, op.timestamp - start, req.decode_blocks)
                req.added_s = None
            if req.prefill_tokens:
                load.prefill_tokens -= req.prefill_tokens
                del load.queue[req.serial]
                req.prefill_tokens = 0
        elif isinstance(op, FreeRequest):
            self._free(self._get(op.request_id, "free"))
        else:
            raise TypeError(f"not an active-sequence operation: {op!r}")

    def get(self, request_id: str) -> _Request:
        return self._get(request_id, "free")

    def held_blocks(self, key: WorkerKey) -> Counter[int]:
        """The blocks held by the requests running on ``key``."""
        ld = self._loads.get(key)
        return ld.blocks if ld is not None else Counter()

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
            op.request_id, key, prefill, op.sequence_hashes, next(self._serial), len(load.blocks), op.timestamp,
        )
        self._requests[op.request_id] = req
        if prefill:
            load.queue[req.serial] = (op.timestamp, prefill)
        load.prefill_tokens += prefill
        load.requests += 1
        load.blocks.update(op.sequence_hashes)
        heapq.heappush(self._expiry, (op.timestamp, req.serial, op.request_id))

    def _free(self, req: _Request) -> None:
        del self._requests[req.request_id]
        load = self._loads[req.key]
        load.prefill_tokens -= req.prefill_tokens
        if req.prefill_tokens:
            del load.queue[req.serial]
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

    def queues_for(self, keys: Sequence[WorkerKey]) -> tuple[tuple[float, tuple[tuple[float, int], ...]] | None, ...]:
        """Per key, its prefill queue and the latest first token at its head (None: no
        load entry)."""
        lds = [self._loads.get(k) for k in keys]
        return tuple(None if ld is None else (ld.last_done, tuple(ld.queue.values())) for ld in lds)


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


# -- the §5 terms, the filters and the selection ----------------------------------------


def worker_logits(
    cfg: SchedulerConfig, isl: int, block_size: int, c: Candidates
) -> LogitColumns:
    """The §5 formula, term by term, for every candidate at once."""
    dev, host, disk, ext, exp = c.overlaps.T
    has_load, apt, adb, reqs, new_blocks = c.loads.T
    credit = (
        cfg.overlap_score_credit * dev
        + cfg.host_cache_hit_weight * host
        + cfg.disk_cache_hit_weight * (disk + ext)
        + cfg.expected_cache_hit_weight * exp
    )
    # Round half away from zero (the reference's f64::round); credit >= 0.
    cached = np.floor(credit * block_size + 0.5)
    prefill = np.where(
        has_load != 0,
        (apt + np.maximum(isl - cached, 0) + cached) / block_size,
        isl / block_size,
    )
    prefill_cost = cfg.prefill_load_scale * np.maximum(0.0, prefill - credit)
    decode = adb + new_blocks
    request_cost = cfg.decode_active_request_weight * reqs
    logit = prefill_cost + decode + request_cost
    return LogitColumns(credit, cached, prefill, prefill_cost, decode, request_cost, logit)


def worker_logit(cfg: SchedulerConfig, isl: int, block_size: int, c: Candidate) -> LogitTerms:
    """The §5 formula for one candidate, term by term."""
    return worker_logits(cfg, isl, block_size, Candidates.from_rows([c])).row(0)


def exclusion(cfg: SchedulerConfig, c: Candidate) -> str | None:
    """Why a candidate may not take the request (filters of §5), or None."""
    if cfg.allowed_workers is not None and c.worker.worker_id not in cfg.allowed_workers:
        return "not in allowed_workers"
    limit = cfg.max_active_decode_blocks
    if limit is not None and c.active_decode_blocks > limit:
        return f"busy: {c.active_decode_blocks} active decode blocks > {limit}"
    limit = cfg.max_active_prefill_tokens
    if limit is not None and c.active_prefill_tokens > limit:
        return f"busy: {c.active_prefill_tokens} active prefill tokens > {limit}"
    return None


def probabilities(logits: Sequence[float], temperature: float) -> list[float]:
    """Selection probabilities of §5 (temperature 0: uniform over the minima)."""
    lo, hi = min(logits), max(logits)
    if temperature == 0 or lo == hi:
        ties = sum(1 for x in logits if x == lo)
        return [1.0 / ties if x == lo else 0.0 for x in logits]
    scale = (hi - lo) * temperature
    weights = [math.exp(-(x - lo) / scale) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def split_ties(probs: list[float], keys: Sequence[WorkerKey], eligible: Sequence[int], part: int, parts: int) -> list[float]:
    """A tie kept to this router's part of the candidates (Router.split_ties): those
    whose place in key order falls in run ``part`` of ``parts`` equal runs, when some but
    not all of the tied ones do."""
    tied = [e for e, p in enumerate(probs) if p > 0]
    if parts < 2 or len(tied) < 2:
        return probs
    rank = {k: pos for pos, k in enumerate(sorted(keys))}
    mine = [e for e in tied if rank[keys[eligible[e]]] * parts // len(keys) == part]
    if not mine or len(mine) == len(tied):
        return probs
    return [1.0 / len(mine) if e in mine else 0.0 for e in range(len(probs))]


def _draw(probs: Sequence[float], rng: random.Random) -> int:
    r = rng.random()
    acc = 0.0
    last = 0
    for i, p in enumerate(probs):
        if p > 0:
            acc += p
            last = i
            if r < acc:
                return i
    return last  # rounding left r just above the running sum

# -- the policies' costs (kvstream/router/costs.py) --------------------------------------


class Cost(Protocol):
    """A policy's cost per candidate (lower wins), given the §5 terms."""

    def __call__(
        self, cfg: SchedulerConfig, isl: int, block_size: int, c: Candidates, terms: LogitColumns
    ) -> np.ndarray: ...


def kv_cost(cfg: SchedulerConfig, isl: int, block_size: int, c: Candidates, terms: LogitColumns) -> np.ndarray:
    return terms.logit


def ttft_cost(cfg: SchedulerConfig, isl: int, block_size: int, c: Candidates, terms: LogitColumns) -> np.ndarray:
    """Predicted time to first token in ms (plus the recompute term)."""
    return predicted_ttft(cfg, isl, block_size, c) * 1000.0


COSTS: dict[str, Cost] = {"kv": kv_cost, "ttft": ttft_cost}


#: The busy share past which the recompute weight grows no more (route.rs's).
BUSY_CAP = 0.9


def ttft_queue(cfg: SchedulerConfig, c: Candidates) -> tuple[np.ndarray, np.ndarray]:
    """Per candidate, the time per prefilled token (seconds) and the prefill queued there
    (tokens: what is left of it)."""
    has_load = c.loads.T[0]
    rates = c.rates if c.rates is not None else np.full(len(c), cfg.ttft_prior_tokens_per_s)
    per_token = 1.0 / rates + np.where(has_load != 0, c.loads.T[2], 0) * c.decode_slowdown_s
    queues = c.queues or (None,) * len(c)
    ahead = np.array([
        queued(q[0], q[1], c.now, float(pt)) if q is not None and h else 0.0
        for q, h, pt in zip(queues, has_load, per_token)
    ])
    return per_token, ahead


def ttft_uncached(cfg: SchedulerConfig, isl: int, block_size: int, c: Candidates) -> np.ndarray:
    """Per candidate, the prompt tokens it would compute (an expected block counted at
    its weight)."""
    dev, host, disk, ext, exp = c.overlaps.T.astype(np.float64)
    return np.maximum(isl - (dev + host + disk + ext + cfg.expected_cache_hit_weight * exp) * block_size, 0.0)


def predicted_ttft(cfg: SchedulerConfig, isl: int, block_size: int, c: Candidates) -> np.ndarray:
    """The ``ttft`` policy's cost of each candidate, in seconds: its predicted time to
    first token, plus the weighted delay its uncached prefill puts on later requests."""
    _, host, disk, ext, _ = c.overlaps.T.astype(np.float64)
    has_load = c.loads.T[0]
    uncached = ttft_uncached(cfg, isl, block_size, c)
    onboard = (cfg.ttft_host_onboard_ratio * host + cfg.ttft_disk_onboard_ratio * (disk + ext)) * block_size
    per_token, ahead = ttft_queue(cfg, c)
    busy = min(float(np.count_nonzero(has_load)) / max(len(c), 1), BUSY_CAP)
    recompute = cfg.ttft_recompute_weight * busy / (1.0 - busy)
    running = np.where(has_load != 0, c.loads.T[3], 0)
    others = cfg.ttft_decode_delay_weight * running * (uncached + onboard)
    return (ahead + (1.0 + recompute) * uncached + onboard + others) * per_token


def within_error(
    cfg: SchedulerConfig, isl: int, block_size: int, c: Candidates, eligible: Sequence[int], logits: list[float]
) -> list[float]:
    """ttft at temperature 0: the eligible costs with those not kept set to +inf: kept are,
    of the costs within ``ttft_error_band`` × the learned error of the lowest (relative),
    those of the candidates with the fewest uncached tokens."""
    band = cfg.ttft_error_band * c.rate_error
    if band <= 0:
        return logits
    limit = min(logits) * (1.0 + band)
    uncached = ttft_uncached(cfg, isl, block_size, c)[list(eligible)].tolist()
    fewest = min(u for u, x in zip(uncached, logits) if x <= limit)
    return [x if x <= limit and u <= fewest else math.inf for x, u in zip(logits, uncached)]


class Scheduler:
    """Scores candidates and picks one. ``rng`` makes tie-breaks and sampling seedable."""

    def __init__(self, config: SchedulerConfig | None = None, rng: random.Random | None = None):
        self.config = config or SchedulerConfig()
        self.rng = rng or random.Random()
        self.split = (0, 1)

    def schedule(
        self,
        isl: int,
        block_size: int,
        candidates: Candidates | Sequence[Candidate],
        overrides: SchedulerOverrides | None = None,
    ) -> Schedule:
        """Score every candidate and choose one.

        Raises NoEligibleWorkerError (saying why) when none may take the request.
        """
        cfg = self.config.with_overrides(overrides)
        if not len(candidates):
            raise NoEligibleWorkerError("no workers known: none has published an event within its lease")
        if not isinstance(candidates, Candidates):
            candidates = Candidates.from_rows(candidates)
        columns = worker_logits(cfg, isl, block_size, candidates)
        columns = columns._replace(logit=COSTS[cfg.policy](cfg, isl, block_size, candidates, columns))
        n = len(candidates)
        filtered = (
            cfg.allowed_workers is not None
            or cfg.max_active_decode_blocks is not None
            or cfg.max_active_prefill_tokens is not None
        )
        if filtered:
            rows = [candidates[i] for i in range(n)]
            excluded = tuple(exclusion(cfg, c) for c in rows)
            eligible = [i for i, r in enumerate(excluded) if r is None]
            if not eligible:
                raise NoEligibleWorkerError(_why_none(cfg, rows, excluded))
            logits = columns.logit[eligible].tolist()
        else:
            excluded = (None,) * n
            eligible = range(n)
            logits = columns.logit.tolist()
        if cfg.policy == "ttft" and cfg.router_temperature == 0:
            logits = within_error(cfg, isl, block_size, candidates, eligible, logits)
        probs = probabilities(logits, cfg.router_temperature)
        if cfg.router_temperature == 0 or min(logits) == max(logits):
            probs = split_ties(probs, candidates.workers, eligible, *self.split)
        chosen = eligible[_draw(probs, self.rng)]
        all_probs = [0.0] * n
        for i, p in zip(eligible, probs):
            all_probs[i] = p
        queued_ = ttft_queue(cfg, candidates)[1] if cfg.policy == "ttft" else None
        band = cfg.ttft_error_band * candidates.rate_error if cfg.policy == "ttft" and cfg.router_temperature == 0 else 0.0
        return Schedule(candidates, columns, tuple(all_probs), excluded, chosen, cfg, queued_, band)


def _why_none(
    cfg: SchedulerConfig, candidates: Sequence[Candidate], reasons: Sequence[str | None]
) -> str:
    if cfg.allowed_workers is not None and all(
        c.worker.worker_id not in cfg.allowed_workers for c in candidates
    ):
        known = sorted({c.worker.worker_id for c in candidates})
        return (
            f"none of the allowed workers {sorted(cfg.allowed_workers)} is known "
            f"(known: {known})"
        )
    detail = "; ".join(
        f"{c.worker.worker_id}/{c.worker.dp_rank}: {r}" for c, r in zip(candidates, reasons)
    )
    return f"all {len(candidates)} candidates are excluded: {detail}"


# -- the router ------------------------------------------------------------------------


class ReferenceRouter:
    """The decision as a composition of the models above, over the production index
    (itself checked against tests/router/reference.py). The subset of
    kvstream.router.Router's methods that the property tests drive."""

    def __init__(
        self,
        config: RouterConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config or RouterConfig()
        self.clock = clock
        self.index = TieredIndex(self.config.expected_ttl_s, self.config.expected_blocks)
        self.active = ActiveSequences(self.config.request_ttl_s, clock)
        self.scheduler = Scheduler(self.config.scheduler, rng)

    def split_ties(self, part: int, parts: int) -> None:
        if not 0 <= part < parts:
            raise ValueError(f"split part {part} of {parts}: needs 0 <= part < parts")
        self.scheduler.split = (part, parts)

    def apply_event(self, event: RouterEvent) -> str | None:
        return self.index.apply(event)

    def workers(self) -> list[WorkerKey]:
        return self.index.workers()

    def knows(self, worker_id: int) -> bool:
        return self.index.knows(worker_id)

    def remove_worker(self, worker_id: int) -> list[WorkerKey]:
        self.active.remove_worker(worker_id)
        return self.index.remove_worker(worker_id)

    def load(self, key: WorkerKey) -> WorkerLoad | None:
        return self.active.load(key)

    def active_requests(self) -> int:
        return len(self.active)

    def learned_rates(self) -> LearnedRates:
        rates = self.active.rates
        return LearnedRates(
            {k: rates.rate(k) for k in rates.keys()}, rates.fleet_rate(), rates.decode_slowdown(),
            rates.error(self.config.scheduler.ttft_rate_scope),
        )

    def reseed(self, seed: int) -> None:
        self.scheduler.rng.seed(seed)

    def prefill_done(self, request_id: str) -> None:
        self.active.apply(PrefillDone(request_id, self.clock()))

    def free(self, request_id: str, refuted: bool = False) -> None:
        req = self.active.get(request_id)
        self.active.apply(FreeRequest(request_id, self.clock(), refuted))
        if refuted:
            # The prompt's blocks no other request running on its worker holds.
            still = self.active.held_blocks(req.key)
            self.index.unexpect(req.key, [h for h in req.hashes if h not in still])

    def find_best_match(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        request_id: str | None = None,
        query_only: bool = False,
        overrides: SchedulerOverrides | None = None,
        *,
        cache_salt: str | None = None,
        mm: Sequence[MmSpan] = (),
        candidates: Sequence[WorkerKey] | None = None,
    ) -> RouteDecision:
        track = request_id is not None and not query_only
        if candidates is None and not self.index.workers():
            raise NoEligibleWorkerError("no workers known: none has published an event within its lease")
        if track and request_id in self.active:
            raise DuplicateRequestError(f"request {request_id!r} is already active")
        now = self.clock()
        block_size = self.config.block_size
        local, seqs = block_hashes(token_ids, block_size, lora_name, cache_salt=cache_salt, mm=mm)
        isl = len(token_ids)
        schedule = self.schedule_hashes(isl, local, seqs, overrides, now, candidates=candidates)
        winner = schedule.candidates.workers[schedule.chosen]
        op = None
        if track:
            assert request_id is not None
            cached = int(schedule.columns.cached_tokens[schedule.chosen])
            op = AddRequest(request_id, winner.worker_id, winner.dp_rank, isl, cached, tuple(seqs), now)
            self.active.apply(op)
            self.index.expect(winner, seqs, now)
        return RouteDecision(winner, request_id, isl, len(seqs), schedule, op)

    def schedule_hashes(
        self,
        isl: int,
        local_hashes: Sequence[int],
        seq_hashes: Sequence[int],
        overrides: SchedulerOverrides | None = None,
        now: float | None = None,
        *,
        candidates: Sequence[WorkerKey] | None = None,
    ) -> Schedule:
        """Score every candidate for a prompt given by its block hashes. Expires old
        requests first; applies nothing else."""
        slots = self.index.candidate_slots(candidates)
        keys = tuple(k for k in slots if k is not None)
        if candidates is not None and not keys:
            raise NoEligibleWorkerError("no candidate worker was given")
        active = self.active
        active.expire(now)
        self.index.expire_expected(self.clock() if now is None else now)
        overlaps = self.index.find_matches_by_tier(local_hashes, seq_hashes)
        n = len(keys)
        flat = chain.from_iterable
        sched = self.scheduler.config.with_overrides(overrides)
        cands = Candidates(
            keys,
            np.fromiter(flat(overlaps.get(k, TierOverlap()) for k in keys), np.int64, 5 * n).reshape(n, 5),
            np.fromiter(flat(active.loads_for(keys, seq_hashes)), np.int64, 5 * n).reshape(n, 5),
            np.array(active.rates.rates_for(keys, sched.ttft_prior_tokens_per_s, sched.ttft_rate_scope), dtype=np.float64),
            active.rates.decode_slowdown(),
            active.queues_for(keys),
            self.clock() if now is None else now,
            active.rates.error(sched.ttft_rate_scope),
        )
        return self.scheduler.schedule(isl, self.config.block_size, cands, overrides)
