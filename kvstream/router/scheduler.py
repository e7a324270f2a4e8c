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
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, get_type_hints

import numpy as np

from kvstream.router.costs import POLICIES
from kvstream.router.errors import SchedulerConfigError
from kvstream.router.index import TierOverlap, WorkerKey
from kvstream.router.rates import RATE_SCOPES


def _option(
    default: Any,
    *,
    per_request: bool = False,
    setting: bool = True,
    positive: bool = False,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A SchedulerConfig field: its default, its bound (a finite number >= 0, or > 0 when
    ``positive``; one of ``choices``), and where else it appears: a request may
    override it (``per_request``: SchedulerOverrides, the HTTP ``weights``), it is a
    ``[router]`` setting (``setting``: kvstream.settings.RouterSettings). Every other
    definition of the field is derived from this one."""
    meta = {"per_request": per_request, "setting": setting, "positive": positive, "choices": choices}
    return field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduling weights and filters (defaults are the reference's, §5)."""

    overlap_score_credit: float = _option(1.0, per_request=True)
    host_cache_hit_weight: float = _option(0.75, per_request=True)
    disk_cache_hit_weight: float = _option(0.25, per_request=True)
    prefill_load_scale: float = _option(1.0, per_request=True)
    decode_active_request_weight: float = _option(0.0, per_request=True)
    router_temperature: float = _option(0.0, per_request=True)
    #: A candidate whose active decode blocks exceed this is busy (None: no limit).
    max_active_decode_blocks: int | None = _option(None, per_request=True)
    #: A candidate whose active prefill tokens exceed this is busy (None: no limit).
    max_active_prefill_tokens: int | None = _option(None, per_request=True)
    #: Only these worker ids may be chosen (None: every known worker).
    allowed_workers: frozenset[int] | None = _option(None, per_request=True, setting=False)
    #: ``kv``: worker_logit (§5, the reference); ``ttft``: the predicted time to first
    #: token (kvstream.router.costs).
    policy: str = _option("kv", per_request=True, choices=POLICIES)
    #: ttft: prefill throughput assumed for a worker before any is observed (tokens/s).
    ttft_prior_tokens_per_s: float = _option(20_000.0, positive=True)
    #: ttft: cost of onboarding a token from host (G2), and from disk (G3) or external
    #: storage, as a fraction of prefilling it (PCIe ~25 GB/s and NVMe ~5 GB/s against
    #: ~20k tokens/s of compute at 128 KiB of KV per token: the simulator's defaults).
    ttft_host_onboard_ratio: float = _option(0.1)
    ttft_disk_onboard_ratio: float = _option(0.5)
    #: ttft: weight of the delay a request's uncached prefill puts on later ones (scaled
    #: by b/(1 - b), b the share of candidates with a request running, at most 0.9).
    ttft_recompute_weight: float = _option(1.0)
    #: ttft: weight of the delay a request's prefill (and onboarding) puts on the
    #: requests already running on the worker: each waits for it between two of its
    #: decode steps (chunked prefill shares the step). 0 for a disaggregated leg.
    ttft_decode_delay_weight: float = _option(1.0, per_request=True)
    #: ttft: price every worker at the fleet's learned throughput ("fleet"), or each at
    #: its own ("worker": for a fleet of unequal GPUs).
    ttft_rate_scope: str = _option("fleet", choices=RATE_SCOPES)
    #: ttft, at temperature 0: candidates whose cost is within this multiple of the
    #: model's learned relative error of the lowest are not told apart by it, and the
    #: one of them holding the most of the prompt cached wins (kvstream.router.costs;
    #: 0: the lowest cost alone).
    ttft_error_band: float = _option(1.0, per_request=True)
    #: The share of an expected block (routed to the worker, not yet confirmed by its
    #: events) counted as cached, under either policy.
    expected_cache_hit_weight: float = _option(1.0, per_request=True)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            choices = f.metadata["choices"]
            if choices is not None:
                if value not in choices:
                    raise SchedulerConfigError(f"{f.name} must be one of {', '.join(choices)}, got {value!r}")
            elif f.name == "allowed_workers":
                if value is not None and not isinstance(value, frozenset):
                    raise SchedulerConfigError(
                        f"allowed_workers must be a frozenset of worker ids, got {value!r}"
                    )
            elif f.metadata["positive"]:
                if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                    raise SchedulerConfigError(f"{f.name} must be a finite number > 0, got {value!r}")
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


def config_fields(*, per_request: bool = False, setting: bool = False) -> list[tuple[dataclasses.Field[Any], Any]]:
    """SchedulerConfig's fields (with their resolved types) that a request may override,
    or that are ``[router]`` settings: what the derived definitions are built from."""
    hints = get_type_hints(SchedulerConfig)
    return [
        (f, hints[f.name])
        for f in fields(SchedulerConfig)
        if (per_request and f.metadata["per_request"]) or (setting and f.metadata["setting"])
    ]


#: Per-request overrides of :class:`SchedulerConfig` (its per-request fields, each
#: optional); None keeps the global value.
SchedulerOverrides = dataclasses.make_dataclass(
    "SchedulerOverrides",
    [(f.name, hint | None, field(default=None)) for f, hint in config_fields(per_request=True)],
    frozen=True,
    slots=True,
)
SchedulerOverrides.__module__ = __name__
SchedulerOverrides.__doc__ = "Per-request overrides of SchedulerConfig; None keeps the global value."


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
    #: Under ttft, the prefill it counted as queued there (what is left of the queue:
    #: kvstream.router.costs), in tokens; None under kv, which reads the whole queue.
    queued_prefill_tokens: float | None = None


@dataclass(frozen=True, slots=True)
class Candidates:
    """Every candidate for one request, as columns (the router scores all known workers
    for every request: one numpy pass instead of a Python loop per worker)."""

    workers: tuple[WorkerKey, ...]
    #: (n, 5): device, host_pinned, disk, external, expected blocks credited.
    overlaps: np.ndarray
    #: (n, 5): has load entry (0/1), active prefill tokens, active decode blocks,
    #: active requests, new blocks.
    loads: np.ndarray

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
    #: Under ttft, per candidate the prefill it counted as queued there, in tokens
    #: (None under kv).
    queued: np.ndarray | None = None
    #: Under ttft at temperature 0, the share of the lowest cost within which costs were
    #: not told apart and the cache decided (kvstream.router.costs; 0: none).
    error_band: float = 0.0

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
            None if self.queued is None else float(self.queued[i]),
        )

    def scores(self) -> tuple[CandidateScore, ...]:
        """Every candidate, flat."""
        return tuple(self.score(i) for i in range(len(self.candidates)))
