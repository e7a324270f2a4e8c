"""Router core (DESIGN.md §4–§6), shaped as NVIDIA Dynamo's kv-router, behind the
:class:`Router` (``router``) that owns its state: callers use its methods, never its
fields. Knows nothing of Kafka: it folds ``kvstream.events.model`` events and
active-sequence ops handed to it.

- ``index``: which worker holds which prefix on which tier (the rules in the compiled
  core, index.rs);
- ``active``: active sequences, the load routed requests put on each worker, as plain
  ops that replicas share;
- ``rates``: prefill throughput and decode slowdown learned online, the ``ttft`` cost's
  inputs;
- ``costs``: the policies' costs behind the ``Cost`` Protocol (``kv``: ``worker_logit``;
  ``ttft``: the predicted time to first token), the one list of policy names;
- ``scheduler``: the configuration (``SchedulerConfig``, the one definition of the
  weights) and a decision's outcome (``Schedule``);
- ``core``: the decision, one call into the compiled core (route.rs);
- ``explain``: a decision as JSON-ready data; ``errors``.

The Python reference models of the index and of the decision are in tests/router/.
"""

from kvstream.router.active import (
    ActiveOp,
    ActiveSequences,
    AddRequest,
    FreeRequest,
    PrefillDone,
    WorkerLoad,
)
from kvstream.router.index import TieredIndex, TierOverlap, WorkerBlocks, WorkerKey
from kvstream.router.router import LearnedRates, RouteDecision, Router, RouterConfig
from kvstream.router.scheduler import (
    Candidate,
    Candidates,
    CandidateScore,
    LogitTerms,
    Schedule,
    SchedulerConfig,
    SchedulerOverrides,
)

__all__ = [
    "ActiveOp",
    "ActiveSequences",
    "AddRequest",
    "Candidate",
    "CandidateScore",
    "Candidates",
    "LogitTerms",
    "FreeRequest",
    "LearnedRates",
    "PrefillDone",
    "RouteDecision",
    "Router",
    "RouterConfig",
    "Schedule",
    "SchedulerConfig",
    "SchedulerOverrides",
    "TierOverlap",
    "TieredIndex",
    "WorkerBlocks",
    "WorkerKey",
    "WorkerLoad",
]
