"""Routing policies (DESIGN.md §5): the cost the compiled core gives each candidate,
lower wins (kvstream/_native_src/src/route.rs, ``trait Cost``; the reference model in
tests/router/reference_router.py).

``kv`` is ``worker_logit`` exactly (the default). ``ttft`` scores each candidate by the
time to first token it predicts there, in ms:

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
    """What the ttft cost reads of the configuration (SchedulerConfig's fields)."""

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
        return LearnedInputs(
            learned.rates_for(keys, cfg.ttft_prior_tokens_per_s, cfg.ttft_rate_scope), learned.decode_slowdown()
        )


#: The policies a router can apply (``SchedulerConfig.policy``), by name: the one place
#: their names are written (settings, the HTTP body and the core read them from here).
COSTS: Mapping[str, Cost] = MappingProxyType({"kv": KvCost(), "ttft": TtftCost()})
POLICIES: tuple[str, ...] = tuple(COSTS)
