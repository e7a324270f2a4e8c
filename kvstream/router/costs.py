"""Routing policies (DESIGN.md §5): the cost the compiled core gives each candidate,
lower wins (kvstream/_native_src/src/route.rs, ``trait Cost``; the reference model in
tests/router/reference_router.py).

``kv`` is ``worker_logit`` exactly (the default). ``ttft`` scores each candidate by the
time to first token it predicts there, in ms:

```
uncached = max(isl − (device + host + disk + external)[w]·B, 0)
onboard  = host_onboard_ratio·host[w]·B + disk_onboard_ratio·(disk + external)[w]·B
per_tok  = 1 / rate[w] + decode_slowdown·active_decode_blocks[w]   # seconds per token
ahead    = w's queued prefill less what its head has computed by now (below)
ttft[w]  = (ahead + uncached + onboard)·per_tok      # seconds
b        = min(share of the candidates with a request running, 0.9)
cost[w]  = ttft[w] + recompute_weight·b/(1 − b)·uncached·per_tok
         + decode_delay_weight·active_requests[w]·(uncached + onboard)·per_tok
```

(``uncached`` counts an expected block, one routed to ``w`` and not confirmed yet, as
cached at ``expected_cache_hit_weight``.) The cost is this request's predicted TTFT
plus the time its uncached prefill adds to the requests routed after it to the same
worker, and to the requests already running there.

Those routed after only wait for it when they have nowhere better to go, which is as
likely as the fleet is busy: the ``ttft_recompute_weight`` is scaled by b/(1 − b), the
delay a unit of work adds to a queue's later arrivals at utilization b (M/M/1), b the
share of candidates with a request running (capped at 0.9). Cache is worth little on an
idle fleet and more the busier it gets. Unscaled, the weight sent a request whose prefix
sat behind a long queue to that queue even while idle workers could compute the prompt
sooner; scaled by the share of candidates with *prefill queued* (until issue 33), it
gave cache away for load at 3× the conversation trace (cached share 0.116 against
sglang-router's 0.132; with b/(1 − b) 0.131 and TTFT p50/p99 184/1381 → 178/1303 ms,
kvstream bench fleet, one run each).

The running ones wait for it for sure: chunked prefill shares each engine step with
their decodes, so each of them takes that much longer to finish
(``ttft_decode_delay_weight``, 1: a second of their time weighs as a second of this
request's TTFT). Prefill moved to an idle worker costs no one else; prefill recomputed
beside running requests, instead of found in a busy worker's cache, costs each of them
(system prompts shared by many users at 3×: end-to-end p99 410 ms with the weight at 0,
260 ms at 1, for 0.8 point of cached share). Those still prefilling count too: queued
first (FCFS), they are decoding by the time this prefill runs, and it delays them then.
Counting only those past their first token gave cache away for load at 3× the
conversation trace (medians of 3 alternating pairs: cached share 0.128 → 0.122, TTFT
p50/p99 186/1,296 → 206/1,393 ms; docs/RESULTS.md).

``ahead`` is not the queued requests' whole uncached prompts: the one at the head of
the worker's queue (first come, first served) is partly done. It could start when it
was routed or at the worker's previous first token, whichever is later, and has been
computed at ``per_tok`` since; those behind it count whole, since they wait for its
first token, which has not come (route.rs, ``Load::queued``; the load's
``prefill_tokens``, which kv and the filters read, stays the whole prompts; explanations
show both, this as ``queued_prefill_tokens``). At 1× the
conversation trace the whole prompts sent a prompt away from the worker holding 95 % of
it, whose 4,298 queued tokens took 192 ms to drain, not the 897 ms they priced. Draining
the whole queue as a fluid at ``per_tok`` instead (the requests behind the head too)
kept as much cache but lengthened the tail under heavy load (``kvstream simulate`` at
speed 3: TTFT p99 5,822–5,902 ms against the head's 5,736–5,746), where the head takes
longer than the rate says and the fluid drains what has not started. The learned rates
time each prompt's own prefill the same way (kvstream.router.rates).

The legs of a disaggregated request delay no decode (the gateway routes both with the
weight at 0, kvstream.gateway.relay): a prefill worker's requests decode elsewhere, and a
decode worker receives the prompt's KV by transfer, which takes no step from the
requests running there.

The cost is a prediction, and a wrong one by the model's own measure
(kvstream.router.rates, ``error``: ~6–10 % on the emulated fleets). Two candidates
whose costs differ by less than that are not told apart by it, and for those the cache
decides: at temperature 0, of the candidates within ``ttft_error_band`` × the learned
error of the lowest cost (relative), those holding the most of the prompt (the fewest
``uncached`` tokens) are kept, and of them the lowest cost wins (route.rs,
``TtftCost::within_error``). The argmin alone gave cache away on differences inside
the model's error (the conversation trace at 3×, medians of 3 against the argmin in the
same session: the share given up for load 0.0081 → 0.0041, cached share 0.1275 →
0.1315, TTFT p99 1,281 → 1,195 ms; docs/RESULTS.md).

Onboarding is counted in prefill-token equivalents (moving a token's KV up a tier costs
that fraction of computing it). ``rate`` and ``decode_slowdown`` are learned online
(kvstream.router.rates). The §5 terms are computed under either policy, for
explanations and for the load a routed request adds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from kvstream.router.index import WorkerKey
from kvstream.router.rates import PrefillRates


class TtftConfig(Protocol):
    """What the ttft cost's inputs read of the configuration (SchedulerConfig's fields)."""

    @property
    def ttft_prior_tokens_per_s(self) -> float: ...

    @property
    def ttft_rate_scope(self) -> str: ...


@dataclass(frozen=True, slots=True)
class LearnedInputs:
    """What a cost reads of the learner for one decision."""

    #: Tokens/s per candidate.
    rates: list[float]
    #: Seconds per prefilled token per active decode block.
    decode_slowdown_s: float
    #: The model's relative error (PrefillRates.error at the configured scope).
    error: float


class Cost(Protocol):
    """A routing policy: the core computes its column; this says what it reads."""

    def inputs(self, learned: PrefillRates, keys: Sequence[WorkerKey], cfg: TtftConfig) -> LearnedInputs | None:
        """The learned inputs the core's cost needs for these candidates (None: none)."""
        ...


class KvCost:
    """``worker_logit`` (§5): reads nothing learned."""

    def inputs(self, learned: PrefillRates, keys: Sequence[WorkerKey], cfg: TtftConfig) -> LearnedInputs | None:
        return None


class TtftCost:
    """The predicted time to first token, at the learned rates."""

    def inputs(self, learned: PrefillRates, keys: Sequence[WorkerKey], cfg: TtftConfig) -> LearnedInputs | None:
        scope = cfg.ttft_rate_scope
        return LearnedInputs(
            learned.rates_for(keys, cfg.ttft_prior_tokens_per_s, scope), learned.decode_slowdown(), learned.error(scope)
        )


#: The policies a router can apply (``SchedulerConfig.policy``), by name: the one place
#: their names are written (settings, the HTTP body and the core read them from here).
COSTS: Mapping[str, Cost] = MappingProxyType({"kv": KvCost(), "ttft": TtftCost()})
POLICIES: tuple[str, ...] = tuple(COSTS)
