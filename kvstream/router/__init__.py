"""Router core (DESIGN.md §4–§6), shaped as NVIDIA Dynamo's kv-router: tier indexes
(``index``), active sequences (``active``), learned prefill rates (``rates``), the
policies' costs (``costs``), the scheduler's configuration and outcome (``scheduler``),
the decision in the compiled core (``core``), behind the :class:`Router` that owns them.

Knows nothing of Kafka: it folds ``kvstream.events.model`` events and active-sequence
ops handed to it.
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
