"""Scheduling (DESIGN.md §5): its configuration, and the outcome of one decision as
columns (the compiled core makes it: kvstream.router.core, route.rs).

The cost of a candidate is the policy's (kvstream.router.costs): ``worker_logit``'s
§5 terms, or the predicted time to first token in ms; lower wins. Temperature 0 takes
the argmin (ties broken uniformly at random), temperature T > 0 samples with
p ∝ exp(−(l − l_min) / ((l_max − l_min)·T)). The Python reference model of every rule
is tests/router/reference_router.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np

from kvstream.router.costs import POLICIES
from kvstream.router.errors import SchedulerConfigError
from kvstream.router.index import TierOverlap, WorkerKey
from kvstream.router.rates import RATE_SCOPES


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduling weights and filters (defaults are the reference's, §5)."""

    overlap_score_credit: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    prefill_load_scale: float = 1.0
    decode_active_request_weight: float = 0.0
    router_temperature: float = 0.0
    #: A candidate whose active decode blocks exceed this is busy (None: no limit).
    max_active_decode_blocks: int | None = None
    #: A candidate whose active prefill tokens exceed this is busy (None: no limit).
    max_active_prefill_tokens: int | None = None
    #: Only these worker ids may be chosen (None: every known worker).
    allowed_workers: frozenset[int] | None = None
    #: ``kv``: worker_logit (§5, the reference); ``ttft``: the predicted time to first
    #: token (kvstream.router.costs).
    policy: str = "kv"
    #: ttft: prefill throughput assumed for a worker before any is observed (tokens/s).
    ttft_prior_tokens_per_s: float = 20_000.0
    #: ttft: cost of onboarding a token from host (G2), and from disk (G3) or external
    #: storage, as a fraction of prefilling it (PCIe ~25 GB/s and NVMe ~5 GB/s against
    #: ~20k tokens/s of compute at 128 KiB of KV per token: the simulator's defaults).
    ttft_host_onboard_ratio: float = 0.1
    ttft_disk_onboard_ratio: float = 0.5
    #: ttft: weight of the delay a request's uncached prefill puts on later ones (scaled
    #: by the share of candidates with prefill queued).
    ttft_recompute_weight: float = 0.5
    #: ttft: price every worker at the fleet's learned throughput ("fleet"), or each at
    #: its own ("worker": for a fleet of unequal GPUs).
    ttft_rate_scope: str = "fleet"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "policy":
                if value not in POLICIES:
                    raise SchedulerConfigError(
                        f"policy must be one of {', '.join(POLICIES)}, got {value!r}"
                    )
            elif f.name == "ttft_rate_scope":
                if value not in RATE_SCOPES:
                    raise SchedulerConfigError(
                        f"ttft_rate_scope must be one of {', '.join(RATE_SCOPES)}, got {value!r}"
                    )
            elif f.name == "ttft_prior_tokens_per_s" and not (
                isinstance(value, int | float) and math.isfinite(value) and value > 0
            ):
                raise SchedulerConfigError(f"{f.name} must be a finite number > 0, got {value!r}")
            elif f.name == "allowed_workers":
                if value is not None and not isinstance(value, frozenset):
                    raise SchedulerConfigError(
                        f"allowed_workers must be a frozenset of worker ids, got {value!r}"
                    )
            elif value is not None and not (
                isinstance(value, int | float) and math.isfinite(value) and value >= 0
            ):
                raise SchedulerConfigError(
                    f"{f.name} must be a finite number >= 0, got {value!r}"
                )

    def with_overrides(self, overrides: SchedulerOverrides | None) -> SchedulerConfig:
        """This config with the fields that ``overrides`` sets replaced."""
        if overrides is None:
            return self
        changes = {
            f.name: getattr(overrides, f.name)
            for f in fields(overrides)
            if getattr(overrides, f.name) is not None
        }
        return dataclasses.replace(self, **changes) if changes else self


@dataclass(frozen=True, slots=True)
class SchedulerOverrides:
    """Per-request overrides of :class:`SchedulerConfig`; None keeps the global value."""

    overlap_score_credit: float | None = None
    host_cache_hit_weight: float | None = None
    disk_cache_hit_weight: float | None = None
    prefill_load_scale: float | None = None
    decode_active_request_weight: float | None = None
    router_temperature: float | None = None
    max_active_decode_blocks: int | None = None
    max_active_prefill_tokens: int | None = None
    allowed_workers: frozenset[int] | None = None
    policy: str | None = None


class Candidate(NamedTuple):
    """What the scheduler knows of one candidate for one request."""

    worker: WorkerKey
    overlap: TierOverlap
    #: False when the worker has no load entry (no active request): prefill = isl/B.
    has_load: bool
    active_prefill_tokens: int
    active_decode_blocks: int
    active_requests: int
    #: Blocks of this request that the worker does not already hold for running requests.
    new_blocks: int


class LogitTerms(NamedTuple):
    """Every term of ``worker_logit`` for one candidate."""

    credit: float
    cached_tokens: int
    prefill_blocks: float
    prefill_cost: float
    decode_blocks: int
    request_cost: float
    logit: float


class CandidateScore(NamedTuple):
    """One candidate, flat: its inputs, every term of worker_logit, and the selection
    outcome (what explanations print)."""

    worker: WorkerKey
    overlap: TierOverlap
    credit: float
    cached_tokens: int
    prefill_blocks: float
    prefill_cost: float
    active_prefill_tokens: int
    active_decode_blocks: int
    new_blocks: int
    decode_blocks: int
    active_requests: int
    request_cost: float
    logit: float
    #: Chance of being chosen (0 for excluded candidates).
    probability: float
    #: Why the candidate could not be chosen (not allowed, busy), else None.
    excluded: str | None


@dataclass(frozen=True, slots=True)
class Candidates:
    """Every candidate for one request, as columns (the router scores all known workers
    for every request: one numpy pass instead of a Python loop per worker)."""

    workers: tuple[WorkerKey, ...]
    #: (n, 4): device, host_pinned, disk, external blocks credited.
    overlaps: np.ndarray
    #: (n, 5): has load entry (0/1), active prefill tokens, active decode blocks,
    #: active requests, new blocks.
    loads: np.ndarray

    @classmethod
    def from_rows(cls, rows: Sequence[Candidate]) -> Candidates:
        n = len(rows)
        return cls(
            tuple(c[0] for c in rows),
            np.array([c[1] for c in rows], dtype=np.int64).reshape(n, 4),
            np.array([c[2:] for c in rows], dtype=np.int64).reshape(n, 5),
        )

    def __len__(self) -> int:
        return len(self.workers)

    def __getitem__(self, i: int) -> Candidate:
        has_load, apt, adb, reqs, new = self.loads[i].tolist()
        return Candidate(self.workers[i], TierOverlap(*self.overlaps[i].tolist()), bool(has_load), apt, adb, reqs, new)


class LogitColumns(NamedTuple):
    """Every term of ``worker_logit``, one array per term (one entry per candidate)."""

    credit: np.ndarray
    cached_tokens: np.ndarray
    prefill_blocks: np.ndarray
    prefill_cost: np.ndarray
    decode_blocks: np.ndarray
    request_cost: np.ndarray
    logit: np.ndarray

    def row(self, i: int) -> LogitTerms:
        credit, cached, prefill, prefill_cost, decode, request_cost, logit = (
            float(col[i]) for col in self
        )
        return LogitTerms(credit, int(cached), prefill, prefill_cost, int(decode), request_cost, logit)


@dataclass(frozen=True, slots=True)
class Schedule:
    """The outcome of scheduling one request: everything needed to explain it."""

    candidates: Candidates
    columns: LogitColumns
    probabilities: tuple[float, ...]
    #: Per candidate, why it was excluded (None: eligible).
    excluded: tuple[str | None, ...]
    chosen: int
    #: The configuration in force (global config with the request's overrides).
    config: SchedulerConfig

    @property
    def terms(self) -> tuple[LogitTerms, ...]:
        return tuple(self.columns.row(i) for i in range(len(self.candidates)))

    def score(self, i: int) -> CandidateScore:
        """Candidate ``i``, flat (built on demand: the hot path keeps columns)."""
        c, t = self.candidates[i], self.columns.row(i)
        return CandidateScore(
            c.worker,
            c.overlap,
            t.credit,
            t.cached_tokens,
            t.prefill_blocks,
            t.prefill_cost,
            c.active_prefill_tokens,
            c.active_decode_blocks,
            c.new_blocks,
            t.decode_blocks,
            c.active_requests,
            t.request_cost,
            t.logit,
            self.probabilities[i],
            self.excluded[i],
        )

    def scores(self) -> tuple[CandidateScore, ...]:
        """Every candidate, flat."""
        return tuple(self.score(i) for i in range(len(self.candidates)))
