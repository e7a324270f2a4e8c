"""Routing policies beside the reference cost (DESIGN.md §5).

``kv`` is ``worker_logit`` exactly (the default). ``ttft`` scores each candidate by the
time to first token it predicts there:

```
ahead    = active_prefill_tokens[w]                  # queued prefill work, in tokens
uncached = max(isl − (device + host + disk + external)[w]·B, 0)
onboard  = host_onboard_ratio·host[w]·B + disk_onboard_ratio·(disk + external)[w]·B
per_tok  = 1 / rate[w] + decode_slowdown·active_decode_blocks[w]   # seconds per token
ttft[w]  = (ahead + uncached + onboard)·per_tok      # seconds
busy     = share of the candidates with prefill queued (ahead > 0)
cost[w]  = ttft[w] + recompute_weight·busy·uncached·per_tok
```

The cost is this request's predicted TTFT plus the time its uncached prefill adds to
the requests routed after it to the same worker. Those requests only wait for it when
they have nowhere better to go, which is as likely as the fleet is busy: the
``ttft_recompute_weight`` is scaled by the share of candidates with prefill queued.
With it the policy keeps cache reuse that shortens everyone's wait once queues are long
(on the Mooncake trace at 3× speed, weight 0.5 against 0: TTFT p50 506 against 527 ms,
p99 4113 against 4204 ms); unscaled, it sent a request whose prefix sat behind a long
queue to that queue even while idle workers could compute the prompt sooner, and some
of those joined the slowest 1 % (docs/RESULTS.md).

Onboarding is counted in prefill-token equivalents (moving a token's KV up a tier costs
that fraction of computing it). ``rate`` is prefill throughput learned online by
:class:`PrefillRates` from what the router observes: a request routed at t0 with
``ahead`` tokens queued before it and ``own`` tokens of its own prefill reports its
first token at t1, so the worker got through ``ahead + own`` tokens in ``t1 − t0``
seconds (its TTFT). Rates are decayed sums (tokens and seconds separately, so large
requests weigh as much as the work they carry), kept per worker. By default
(``ttft_rate_scope = "fleet"``) the policy prices every worker at the fleet's rate, the
per-worker sums pooled: one TTFT also carries what the router cannot see (onboarding
that dedup reports as device hits, prefill already done of the requests counted
ahead), so the per-worker estimates of identical workers drift apart with their
traffic (13k–18k tokens/s on the Mooncake trace) and long prompts chased the worker
that looked fastest past idle ones. ``"worker"`` prices each at its own rate, for a
fleet of unequal GPUs; a worker with no sample yet gets the mean of the known rates,
or the configured prior when none is known.

``decode_slowdown`` (seconds per prefilled token per active decode block) is learned
from the same observations, for the whole fleet: the requests already running on a
worker slow its prefill (every step of a chunked prefill also decodes them and reads
their KV, so a prompt of more chunks pays that more often), and they hold its memory
and batch slots (a long prompt waits for room in G1 while they decode). Queued prefill
alone shows neither. The model is ``TTFT = tokens·(1 / rate[w] + decode_slowdown·
decode_blocks)`` (decode blocks as the router saw them when it routed the request),
fitted by alternating least squares on decayed sums: each worker's rate from its TTFTs
less the current slowdown, and the slowdown from the residuals against the current
rates (never below 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvstream.router.index import WorkerKey

if TYPE_CHECKING:
    from kvstream.router.scheduler import Candidates, SchedulerConfig

#: The policies a router can apply (``SchedulerConfig.policy``).
POLICIES = ("kv", "ttft")

#: Whose throughput prices a worker in ``ttft`` (``SchedulerConfig.ttft_rate_scope``):
#: the fleet's pooled rate, or the worker's own.
RATE_SCOPES = ("fleet", "worker")

#: Weight of the newest observation in the decayed sums of :class:`PrefillRates`: small,
#: because one request's TTFT is a noisy sample (the work queued ahead of it was partly
#: done already); at 0.1 the noise alone made identical workers look different enough
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
        #: decayed Σ x·residual and Σ x², x = tokens·decode_blocks (the slowdown's regression)
        self._slowdown_sums = (0.0, 0.0)

    def observe(self, key: WorkerKey, tokens: int, seconds: float, decode_blocks: int = 0) -> None:
        """The worker went through ``tokens`` of prefill in ``seconds`` while holding
        ``decode_blocks`` for running requests (when the request was routed). Samples
        with no elapsed time (clock skew, a replay at one instant) carry no rate and are
        ignored."""
        if not seconds > 0 or tokens < 0:
            return
        a = self.alpha
        rate = self.rate(key)
        x = float(tokens) * decode_blocks
        if rate and x > 0:
            xy, xx = self._slowdown_sums
            self._slowdown_sums = ((1 - a) * xy + a * x * (seconds - tokens / rate), (1 - a) * xx + a * x * x)
        net = max(seconds - self.decode_slowdown() * x, 0.0)
        t, s = self._sums.get(key, (float(tokens), net))
        self._sums[key] = ((1 - a) * t + a * tokens, (1 - a) * s + a * net)

    def decode_slowdown(self) -> float:
        """Seconds per prefilled token per active decode block of the worker (>= 0)."""
        xy, xx = self._slowdown_sums
        return max(xy / xx, 0.0) if xx > 0 else 0.0

    def rate(self, key: WorkerKey) -> float | None:
        sums = self._sums.get(key)
        if sums is None or sums[1] <= 0:
            return None
        return sums[0] / sums[1]

    def fleet_rate(self) -> float | None:
        """The workers' decayed sums pooled: the fleet's tokens/s (None: no sample)."""
        tokens = sum(t for t, _ in self._sums.values())
        seconds = sum(s for _, s in self._sums.values())
        return tokens / seconds if seconds > 0 else None

    def rates_for(self, keys: Sequence[WorkerKey], prior: float, scope: str) -> np.ndarray:
        """Tokens/s per key. ``scope="fleet"``: the fleet's rate for every key (``prior``
        before any sample); ``"worker"``: each key's own, the mean known rate for a key
        with none, else ``prior``."""
        if scope == "fleet":
            fleet = self.fleet_rate()
            return np.full(len(keys), fleet if fleet is not None else prior, dtype=np.float64)
        known = [self.rate(k) for k in keys]
        seen = [r for r in known if r is not None and r > 0]
        fallback = float(np.mean(seen)) if seen else prior
        return np.array([r if r is not None and r > 0 else fallback for r in known], dtype=np.float64)

    def keys(self) -> list[WorkerKey]:
        return list(self._sums)

    def forget(self, key: WorkerKey) -> None:
        self._sums.pop(key, None)


def predicted_ttft(cfg: SchedulerConfig, isl: int, block_size: int, c: Candidates) -> np.ndarray:
    """The ``ttft`` policy's cost of each candidate, in seconds: its predicted time to
    first token, plus the weighted delay its uncached prefill puts on later requests."""
    dev, host, disk, ext = c.overlaps.T.astype(np.float64)
    has_load, apt = c.loads.T[0], c.loads.T[1]
    ahead = np.where(has_load != 0, apt, 0).astype(np.float64)
    uncached = np.maximum(isl - (dev + host + disk + ext) * block_size, 0.0)
    onboard = (cfg.ttft_host_onboard_ratio * host + cfg.ttft_disk_onboard_ratio * (disk + ext)) * block_size
    rates = c.rates if c.rates is not None else np.full(len(c), cfg.ttft_prior_tokens_per_s)
    per_token = 1.0 / rates + np.where(has_load != 0, c.loads.T[2], 0) * c.decode_slowdown_s
    recompute = cfg.ttft_recompute_weight * float(np.count_nonzero(ahead)) / max(len(c), 1)
    return (ahead + (1.0 + recompute) * uncached + onboard) * per_token
