"""``replay explain``: a routing decision as the router would have computed it at time T.

The index is the fold as of T (kvstream.tools.replay.rebuild); the load and the
predicted blocks are the active-sequence ops of ``kvstream.active`` routed at or before
T, applied among the events' records in time order as a caught-up replica met them
(an expiry drops the requests routed before it, a store confirms a prediction made
before it), with the router's clock held at T (so requests and predictions older than
their TTLs are expired as they were). The decision is then
scored by the router itself and printed as
:func:`kvstream.router.explain.decision_dict` with ``explain=True``: the very structure
the live ``POST /v1/route`` returns with ``"explain": true``.

With ``--request-id``, the request's ADD op gives T, the prompt (its sequence hashes
and length) and the worker the live router chose; the load is every op before it.

The candidates are those the live replica admitted (kvstream.replica.admission): the
workers registered on ``kvstream.workers`` as of T (kvstream.tools.replay.registry) or
in ``[[gateway.workers]]``, unless ``[router] require_registration`` is off.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstream.events.errors import DecodeError
from kvstream.replica.active_codec import ActiveOpCodec, load_window_start_ms
from kvstream.replica.admission import admission_from_settings
from kvstream.replica.cli import router_config
from kvstream.replica.request_ids import unscoped
from kvstream.replica.route_body import InvalidRequest, RouteRequest, from_doc, overrides
from kvstream.router.active import ActiveOp, AddRequest
from kvstream.router.errors import NoEligibleWorkerError, SchedulerConfigError
from kvstream.router.explain import decision_dict
from kvstream.router.index import WorkerKey
from kvstream.router.router import RouteDecision, Router, RouterConfig
from kvstream.settings import Settings
from kvstream.tools.replay.errors import ReplayError, SourceError
from kvstream.tools.replay.reader import LogReader, format_time
from kvstream.tools.replay.rebuild import rebuild_at
from kvstream.tools.replay.registry import RegistryAt, registry_at

#: Active-op records are stamped by the broker client a moment after the op's own time:
#: read this much (ms) beyond both ends of the window, then select by the op's time.
_SLACK_MS = 60_000


@dataclass(frozen=True, slots=True)
class LoggedOp:
    timestamp_ms: int
    partition: int
    offset: int
    replica_id: str
    op: ActiveOp

    @property
    def order(self) -> tuple[int, int, int]:
        return self.timestamp_ms, self.partition, self.offset


@dataclass(slots=True)
class Explained:
    decision: dict[str, Any]
    at_ms: int
    notes: list[str] = field(default_factory=list)


def read_ops(settings: Settings, start_ms: int | None, end_ms: int | None, progress: bool | None) -> tuple[list[LoggedOp], int]:
    """Active ops stamped in ``[start_ms, end_ms]`` (None: the whole topic), ordered by
    their time; and how many records could not be decoded."""
    codec = ActiveOpCodec()
    ops: list[LoggedOp] = []
    bad = 0
    with LogReader(settings, "active") as reader:
        start = dict(reader.low) if start_ms is None else reader.offsets_at(start_ms - _SLACK_MS)
        if start_ms is not None:
            reader.check_retained(start, f"the load window before {format_time(start_ms)}")
        end = dict(reader.high) if end_ms is None else reader.offsets_after(end_ms + _SLACK_MS)
        for r in reader.read(start, end, progress=progress, desc="active ops"):
            try:
                if r.value is None:
                    raise DecodeError("no value")
                replica_id, op = codec.decode(r.value)
            except DecodeError:
                bad += 1
                continue
            ms = round(op.timestamp * 1000)
            if (start_ms is None or ms >= start_ms) and (end_ms is None or ms <= end_ms):
                ops.append(LoggedOp(ms, r.partition, r.offset, replica_id, op))
    ops.sort(key=lambda o: o.order)
    return ops, bad


def load_request(path: Path) -> RouteRequest:
    """A prompt from a file: the JSON body of a ``POST /v1/route`` call, a JSON array of
    token ids, or token ids separated by spaces or commas."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror}") from None
    try:
        doc: Any = json.loads(text)
    except json.JSONDecodeError:
        try:
            doc = [int(t) for t in text.replace(",", " ").split()]
        except ValueError:
            raise SourceError(
                f"{path} is neither JSON nor token ids separated by spaces or commas"
            ) from None
    try:
        return from_doc({"token_ids": doc} if isinstance(doc, list) else doc)
    except InvalidRequest as exc:
        raise SourceError(f"{path}: {exc}") from None


def _decide_from_hashes(
    router: Router, add: AddRequest, now: float, candidates: Sequence[WorkerKey] | None
) -> RouteDecision:
    """Score a logged request from its sequence hashes (the log keeps no token ids),
    query-only."""
    return router.decide_logged(add.isl, add.sequence_hashes, unscoped(add.request_id), now, candidates=candidates)


def _score(fn: Any) -> RouteDecision:
    try:
        return fn()
    except NoEligibleWorkerError as exc:
        raise ReplayError(f"no worker could take the request at that time: {exc}") from None
    except (SchedulerConfigError, ValueError) as exc:
        raise ReplayError(f"cannot score the request: {exc}") from None


def _admitted(settings: Settings, router: Router, registry: RegistryAt) -> tuple[list[WorkerKey] | None, list[str]]:
    """The candidates the live rule gives (NoEligibleWorkerError when none), and notes."""
    candidates = admission_from_settings(settings).candidates(router, registry.registered)
    if candidates is None:
        return None, ["every indexed worker competes ([router] require_registration = false)"]
    hidden = sorted(w for w in registry.later if router.knows(w))
    notes = [registry.note]
    if hidden:
        notes.append(f"workers {hidden[:16]} registered only after that time on the compacted registry: "
                     "an earlier registration may have been compacted away")
    return candidates, notes


def explain_at(
    settings: Settings,
    at_ms: int,
    req: RouteRequest,
    snapshot_dir: Path | None = None,
    *,
    progress: bool | None = None,
) -> Explained:
    """The decision for prompt ``req`` had it been routed at ``at_ms``."""
    config = router_config(settings)
    ops, bad = read_ops(settings, load_window_start_ms(at_ms, config), at_ms, progress)
    rebuilt = rebuild_at(settings, at_ms, snapshot_dir, progress=progress, ops=ops)
    router = rebuilt.fold.router
    registry = registry_at(settings, at_ms, progress)
    candidates, admitted = _score(lambda: _admitted(settings, router, registry))
    decision = _score(
        lambda: router.find_best_match(
            req.token_ids, req.lora_name, req.request_id, query_only=True, overrides=overrides(req),
            candidates=candidates,
        )
    )
    notes = [f"index from {rebuilt.source}, {rebuilt.records} records", *rebuilt.notes, *admitted,
             f"load and predicted blocks from {len(ops)} active ops among them "
             f"({rebuilt.ops_refused} refused, {bad} undecodable)"]
    return Explained(decision_dict(decision, explain=True), at_ms, notes)


def find_request(ops: list[LoggedOp], request_id: str) -> LoggedOp:
    # Logged ids are scoped by their replica (kvstream.replica.request_ids): match the
    # scoped id, or the client's id (the newest such request, whichever replica took it).
    adds = [
        o for o in ops
        if isinstance(o.op, AddRequest) and request_id in (o.op.request_id, unscoped(o.op.request_id))
    ]
    if not adds:
        raise ReplayError(
            f"request {request_id!r} is not in the active topic (never routed with that id, "
            "routed query-only, or older than the topic's retention)"
        )
    return adds[-1]


def ops_before(ops: Sequence[LoggedOp], logged: LoggedOp, config: RouterConfig) -> list[LoggedOp]:
    """The ops a live replica had applied when it routed ``logged``: those of the load
    window (kvstream.replica.active_codec.load_window_start_ms) before it."""
    since_ms = load_window_start_ms(logged.timestamp_ms, config)
    return [o for o in ops if since_ms <= o.timestamp_ms and o.order < logged.order]


def decide_logged(router: Router, logged: LoggedOp, candidates: Sequence[WorkerKey] | None = None) -> RouteDecision:
    """The decision for the logged request ``logged``, given the fold as of its time
    with the ops before it (``router``), among ``candidates`` (None: every indexed
    worker)."""
    add = logged.op
    assert isinstance(add, AddRequest)
    return _score(lambda: _decide_from_hashes(router, add, logged.timestamp_ms / 1000, candidates))


def explain_request(
    settings: Settings,
    request_id: str,
    snapshot_dir: Path | None = None,
    *,
    progress: bool | None = None,
) -> Explained:
    """The decision taken for a logged request, recomputed at the time it was routed."""
    ops, bad = read_ops(settings, None, None, progress)
    logged = find_request(ops, request_id)
    add = logged.op
    assert isinstance(add, AddRequest)
    at_ms = logged.timestamp_ms
    before = ops_before(ops, logged, router_config(settings))
    rebuilt = rebuild_at(settings, at_ms, snapshot_dir, progress=progress, ops=before)
    router = rebuilt.fold.router
    candidates, admitted = _score(lambda: _admitted(settings, router, registry_at(settings, at_ms, progress)))
    decision = decide_logged(router, logged, candidates)
    notes = [f"request routed at {format_time(at_ms)} by {logged.replica_id}",
             f"index from {rebuilt.source}, {rebuilt.records} records", *rebuilt.notes, *admitted,
             f"load and predicted blocks from {len(before)} active ops among them "
             f"({rebuilt.ops_refused} refused, {bad} undecodable)"]
    live = WorkerKey(add.worker_id, add.dp_rank)
    if decision.worker != live:
        notes.append(
            f"the live router chose worker {live.worker_id} rank {live.dp_rank}, this replay "
            f"chooses {decision.worker.worker_id} rank {decision.worker.dp_rank}: a tie broken "
            "at random, per-request weights (not logged), or load the live replica had not "
            "received yet"
        )
    return Explained(decision_dict(decision, explain=True), at_ms, notes)


def table(d: dict[str, Any]) -> list[str]:
    """The decision for people: one line per candidate, the winner marked."""
    lines = [
        f"request {d['request_id'] or '-'}: isl {d['isl']} tokens, {d['blocks']} blocks → "
        f"worker {d['worker_id']} rank {d['dp_rank']} (logit {d['logit']:.3f})",
        f"  {'':1} {'worker':>20} {'rank':>4} {'dev':>4} {'host':>4} {'disk':>4} {'ext':>4} "
        f"{'credit':>7} {'cached':>6} {'prefill':>8} {'p.cost':>7} {'act.pf':>6} {'queued':>7} {'act.dec':>7} "
        f"{'new':>4} {'decode':>6} {'reqs':>4} {'r.cost':>6} {'logit':>8} {'prob':>5}  excluded",
    ]
    for c in d["candidates"]:
        o = c["overlap"]
        win = "*" if (c["worker_id"], c["dp_rank"]) == (d["worker_id"], d["dp_rank"]) else " "
        lines.append(
            f"  {win} {c['worker_id']:>20} {c['dp_rank']:>4} {o['device']:>4} {o['host_pinned']:>4} "
            f"{o['disk']:>4} {o['external']:>4} {c['credit']:>7.2f} {c['cached_tokens']:>6} "
            f"{c['prefill_blocks']:>8.2f} {c['prefill_cost']:>7.2f} {c['active_prefill_tokens']:>6} "
            f"{'-' if c['queued_prefill_tokens'] is None else round(c['queued_prefill_tokens']):>7} "
            f"{c['active_decode_blocks']:>7} {c['new_blocks']:>4} {c['decode_blocks']:>6} "
            f"{c['active_requests']:>4} {c['request_cost']:>6.2f} {c['logit']:>8.3f} "
            f"{c['probability']:>5.2f}  {c['excluded'] or ''}"
        )
    return lines
