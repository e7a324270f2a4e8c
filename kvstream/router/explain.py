"""A routing decision as plain JSON-ready data: the live API's explain mode and
``kvstream replay explain`` print exactly this, so the two can be compared."""

from __future__ import annotations

from typing import Any

from kvstream.router.router import RouteDecision
from kvstream.router.scheduler import CandidateScore


def candidate_dict(c: CandidateScore) -> dict[str, Any]:
    return {
        "worker_id": c.worker.worker_id,
        "dp_rank": c.worker.dp_rank,
        "overlap": c.overlap._asdict(),
        "credit": c.credit,
        "cached_tokens": c.cached_tokens,
        "prefill_blocks": c.prefill_blocks,
        "prefill_cost": c.prefill_cost,
        "active_prefill_tokens": c.active_prefill_tokens,
        "queued_prefill_tokens": c.queued_prefill_tokens,
        "active_decode_blocks": c.active_decode_blocks,
        "new_blocks": c.new_blocks,
        "decode_blocks": c.decode_blocks,
        "active_requests": c.active_requests,
        "request_cost": c.request_cost,
        "logit": c.logit,
        "probability": c.probability,
        "excluded": c.excluded,
    }


def decision_dict(d: RouteDecision, explain: bool = False) -> dict[str, Any]:
    chosen = d.chosen
    out: dict[str, Any] = {
        "worker_id": d.worker.worker_id,
        "dp_rank": d.worker.dp_rank,
        "request_id": d.request_id,
        "isl": d.isl,
        "blocks": d.blocks,
        "overlap": chosen.overlap._asdict(),
        "cached_tokens": chosen.cached_tokens,
        "policy": d.schedule.config.policy,
        "logit": chosen.logit,
    }
    if explain:
        out["candidates"] = [candidate_dict(c) for c in d.candidates]
        out["error_band"] = d.schedule.error_band
    return out
