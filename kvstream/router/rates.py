"""Prefill throughput learned online (DESIGN.md §5): the ``ttft`` cost's inputs
(kvstream.router.costs), from the times to first token the router observes.

:class:`PrefillRates` learns from what the router observes: a request's prefill starts
when it is routed (t0) or when the previous first token on its worker comes, whichever
is later (engines prefill first come, first served), and ends at its own first token
(t1); so the worker computed the ``own`` uncached tokens of its prompt in ``t1 −
max(t0, previous first token)`` seconds (kvstream/_native_src/src/route.rs,
``prefill_done``). Counting the whole queue found ahead at t0 instead overstated the
work (the prompt being computed was partly done) and the rate with it. Rates are decayed
sums (tokens and seconds separately, so large requests weigh as much as the work they
carry), kept per worker. By default (``ttft_rate_scope = "fleet"``) the policy prices
every worker at the fleet's rate, the per-worker sums pooled: one prefill also carries
what the router cannot see (onboarding that dedup reports as device hits, the chunks
it shares with the requests beside it), so the per-worker estimates of identical
workers drift apart with their traffic (13k–18k tokens/s on the Mooncake trace) and
long prompts chased the worker that looked fastest past idle ones. ``"worker"`` prices
each at its own rate, for a fleet of unequal GPUs; a worker with no sample yet gets the
mean of the known rates, or the configured prior when none is known.

``decode_slowdown`` (seconds per prefilled token per active decode block) is learned
from the same observations, for the whole fleet: the requests already running on a
worker slow its prefill (every step of a chunked prefill also decodes them and reads
their KV, so a prompt of more chunks pays that more often), and they hold its memory
and batch slots (a long prompt waits for room in G1 while they decode). Queued prefill
alone shows neither. The model is ``time = tokens·(1 / rate[w] + decode_slowdown·
decode_blocks)`` (decode blocks as the router saw them when it routed the request),
fitted by alternating least squares on decayed sums: each worker's rate from its TTFTs
less the current slowdown, and the slowdown from the residuals against the current
rates (never below 0).

:meth:`PrefillRates.error` is how far off that model is: the decayed mean of
``|observed − predicted| / predicted`` over the observations (weighted by their tokens,
as the rates are), each predicted by the model as it stood before that observation, at
the rate of each scope. Two candidates whose predicted times differ by less than that
are not told apart by the model (the ttft policy's ``ttft_error_band``). On 8 emulated
engines it is ~6 % at 1× the system-prompts trace and ~10 % at 3× (the median
observation's error 6–7 %, the worst tenth's 20 % and more: a prefill that shared its
steps with another's chunks).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstream.router.index import WorkerKey

#: Whose throughput prices a worker in ``ttft`` (``SchedulerConfig.ttft_rate_scope``):
#: the fleet's pooled rate, or the worker's own.
RATE_SCOPES = ("fleet", "worker")

#: Weight of the newest observation in the decayed sums of :class:`PrefillRates`: small,
#: because one request's prefill time is a noisy sample (it shares its steps with the
#: chunks and decodes beside it); at 0.1 the noise alone made identical workers look different enough
#: to cost 15% of TTFT p99 on the Mooncake trace, at 0.01 it no longer does.
DEFAULT_RATE_ALPHA = 0.01


class PrefillRates:
    """Per-worker prefill throughput (tokens/s), and the fleet's prefill slowdown per
    active decode block (seconds per token), from observed times to first token."""

    def __init__(self, alpha: float = DEFAULT_RATE_ALPHA) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = alpha
        #: worker → (decayed tokens, decayed seconds less the decode slowdown)
        self._sums: dict[WorkerKey, tuple[float, float]] = {}
        #: Σ of _sums' tokens and seconds over the workers, kept as they change (the
        #: fleet's rate is read for every decision and observation: not a pass per read)
        self._pooled = (0.0, 0.0)
        #: decayed Σ x·residual and Σ x², x = tokens·decode_blocks (the slowdown's regression)
        self._slowdown_sums = (0.0, 0.0)
        #: per rate scope: decayed Σ tokens·relative error and Σ tokens (error())
        self._error_sums = dict.fromkeys(RATE_SCOPES, (0.0, 0.0))

    def observe(self, key: WorkerKey, tokens: int, seconds: float, decode_blocks: int = 0) -> None:
        """The worker went through ``tokens`` of prefill in ``seconds`` while holding
        ``decode_blocks`` for running requests (when the request was routed). Samples
        with no elapsed time (clock skew, a replay at one instant) or no tokens (a prompt
        found whole in the cache) carry no rate and are ignored."""
        if not seconds > 0 or tokens <= 0:
            return
        a = self.alpha
        rate = self.rate(key)
        x = float(tokens) * decode_blocks
        slowdown = self.decode_slowdown()
        for scope, r in {"fleet": self.fleet_rate(), "worker": rate}.items():
            if r:
                predicted = tokens / r + slowdown * x
                e, w = self._error_sums[scope]
                self._error_sums[scope] = ((1 - a) * e + a * tokens * abs(seconds - predicted) / predicted,
                                           (1 - a) * w + a * tokens)
        if rate and x > 0:
            xy, xx = self._slowdown_sums
            self._slowdown_sums = ((1 - a) * xy + a * x * (seconds - tokens / rate), (1 - a) * xx + a * x * x)
        net = max(seconds - self.decode_slowdown() * x, 0.0)
        old = self._sums.get(key)
        t, s = old if old is not None else (float(tokens), net)
        new = self._sums[key] = ((1 - a) * t + a * tokens, (1 - a) * s + a * net)
        pt, ps = self._pooled
        ot, os_ = old if old is not None else (0.0, 0.0)
        self._pooled = (pt + new[0] - ot, ps + new[1] - os_)

    def decode_slowdown(self) -> float:
        """Seconds per prefilled token per active decode block of the worker (>= 0)."""
        xy, xx = self._slowdown_sums
        return max(xy / xx, 0.0) if xx > 0 else 0.0

    def error(self, scope: str) -> float:
        """The model's relative error priced at ``scope``'s rates (0 before a sample)."""
        e, w = self._error_sums[scope]
        return e / w if w > 0 else 0.0

    def rate(self, key: WorkerKey) -> float | None:
        sums = self._sums.get(key)
        if sums is None or sums[1] <= 0:
            return None
        return sums[0] / sums[1]

    def fleet_rate(self) -> float | None:
        """The workers' decayed sums pooled: the fleet's tokens/s (None: no sample)."""
        tokens, seconds = self._pooled
        return tokens / seconds if seconds > 0 else None

    def rates_for(self, keys: Sequence[WorkerKey], prior: float, scope: str) -> list[float]:
        """Tokens/s per key. ``scope="fleet"``: the fleet's rate for every key (``prior``
        before any sample); ``"worker"``: each key's own, the mean known rate for a key
        with none, else ``prior``."""
        if scope == "fleet":
            fleet = self.fleet_rate()
            return [fleet if fleet is not None else prior] * len(keys)
        known = [self.rate(k) for k in keys]
        seen = [r for r in known if r is not None and r > 0]
        fallback = float(np.mean(seen)) if seen else prior
        return [r if r is not None and r > 0 else fallback for r in known]

    def keys(self) -> list[WorkerKey]:
        return list(self._sums)

    def forget(self, key: WorkerKey) -> None:
        if self._sums.pop(key, None) is not None:  # rare (a worker gone): summed afresh
            self._pooled = (sum(t for t, _ in self._sums.values()), sum(s for _, s in self._sums.values()))
