"""Router core (DESIGN.md §4–§6): tier indexes, scheduler, active sequences, Router.

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
from kvstream.router.router import RouteDecision, Router, RouterConfig
from kvstream.router.scheduler import (
    Candidate,
    Candidates,
    CandidateScore,
    LogitTerms,
    Schedule,
    Scheduler,
    SchedulerConfig,
    SchedulerOverrides,
    worker_logit,
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
    "PrefillDone",
    "RouteDecision",
    "Router",
    "RouterConfig",
    "Schedule",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOverrides",
    "TierOverlap",
    "TieredIndex",
    "WorkerBlocks",
    "WorkerKey",
    "WorkerLoad",
    "worker_logit",
]
