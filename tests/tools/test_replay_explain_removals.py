"""``replay explain`` agrees with the live router across worker expiries and restarts
with requests in flight, and with the blocks predicted by routed requests: the live
fold's ``Router.remove_worker`` drops an expired worker's requests, a new incarnation
drops its predictions, a store confirms them, and replay folds the records and the
active ops in the same order.

The live side is the replica's own pieces in the order a caught-up replica runs them:
the events fold (records in time order) and the router taking requests in between;
its ops go through the active topic's codec, as replay reads them. The replay side is
``kvstream.tools.replay``'s own fold and ``decide_logged``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstream.events.model import EventBatch
from kvstream.replica.active_codec import ActiveOpCodec
from kvstream.events.wire import worker_key
from kvstream.replica.authority import authority_from_settings
from kvstream.replica.cli import router_config
from kvstream.replica.fold import LogFold
from kvstream.replica.request_ids import scoped
from kvstream.router import Router
from kvstream.router.errors import NoEligibleWorkerError, RouterError
from kvstream.router.explain import decision_dict
from kvstream.settings import Settings
from kvstream.tools.replay.explain import LoggedOp, decide_logged, ops_before
from kvstream.tools.replay.rebuild import fold_records, new_fold
from kvstream.tools.replay.reader import Record

from tests.replica.helpers import CODEC, FakeWorkerLog

LEASE_MS = 1_000
REPLICA = "r1"
PROMPTS = [list(range(16 * 4)), list(range(16 * 2)) + list(range(5_000, 5_000 + 32))]
SETTINGS = Settings()


@dataclass
class Live:
    """A replica caught up with the log: each record is folded when it is written."""

    now_ms: int = 1_000_000
    records: list[Record] = field(default_factory=list)
    ops: list[LoggedOp] = field(default_factory=list)
    explained: dict[str, dict[str, Any]] = field(default_factory=dict)
    workers: dict[int, FakeWorkerLog] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fold = LogFold(
            Router(router_config(SETTINGS), clock=lambda: self.now_ms / 1000), CODEC,
            authority_from_settings(SETTINGS.fold),
        )
        self.codec = ActiveOpCodec()

    def record(self, value: bytes | None, key: bytes | None = None, tick: bool = False) -> None:
        r = Record(0, len(self.records), self.now_ms, key, value, tick)
        self.records.append(r)
        self.fold.apply_record(r.partition, r.offset, r.timestamp_ms, r.value, r.is_tick, r.key)

    def publish(self, wid: int, restart: bool, blocks: int) -> None:
        w = self.workers.get(wid)
        if w is None or restart:
            # A new incarnation: a new epoch that starts with its `cleared`.
            w = self.workers[wid] = FakeWorkerLog(wid, epoch=(w.epoch + 1 if w else 1), lease_ms=LEASE_MS)
            events = [w.cleared(), w.stored(PROMPTS[wid % 2][: 16 * blocks])] if blocks else [w.cleared()]
        else:
            events = [w.stored(PROMPTS[wid % 2][: 16 * blocks])] if blocks else []
        self.record(CODEC.encode(EventBatch(wid, w.epoch, LEASE_MS, tuple(events))), worker_key(wid))

    def log_op(self, op: Any) -> None:
        replica_id, decoded = self.codec.decode(self.codec.encode(REPLICA, op))
        self.ops.append(LoggedOp(round(decoded.timestamp * 1000), 0, len(self.ops), replica_id, decoded))

    def route(self, rid: str, prompt: int) -> None:
        try:
            d = self.fold.router.find_best_match(PROMPTS[prompt], request_id=scoped(REPLICA, rid))
        except NoEligibleWorkerError:
            return
        assert d.op is not None
        self.log_op(d.op)
        self.explained[rid] = decision_dict(d, explain=True)

    def free(self, rid: str) -> None:
        try:
            self.log_op(self.fold.router.free(scoped(REPLICA, rid)))
        except RouterError:
            pass  # dropped with its worker, or never routed: a live replica answers 404


def replayed(live: Live, rid: str) -> dict[str, Any]:
    logged = next(o for o in live.ops if o.op.request_id == scoped(REPLICA, rid) and hasattr(o.op, "isl"))
    fold = new_fold(SETTINGS, logged.timestamp_ms / 1000)
    records = [r for r in live.records if r.timestamp_ms <= logged.timestamp_ms]
    fold_records(fold, records, ops_before(live.ops, logged, router_config(SETTINGS)))
    return decision_dict(decide_logged(fold.router, logged), explain=True)


def by_worker(d: dict[str, Any]) -> list[dict[str, Any]]:
    """What the explanation says of each candidate (the chosen one may differ on a tie
    broken at random; the candidates' scores may not)."""
    return sorted(d["candidates"], key=lambda c: (c["worker_id"], c["dp_rank"]))


step = st.one_of(
    st.tuples(st.just("publish"), st.sampled_from([20, 21]), st.booleans(), st.integers(0, 4)),
    st.tuples(st.just("tick")),
    st.tuples(st.just("route"), st.integers(0, 1)),
    st.tuples(st.just("free"), st.integers(0, 7)),
)


def run(steps: list[tuple[Any, ...]], gaps: list[int]) -> Live:
    live = Live()
    routed = 0
    for s, gap in zip(steps, gaps):
        live.now_ms += gap  # every step at its own millisecond: the order is the log's
        if s[0] == "publish":
            live.publish(s[1], s[2], s[3])
        elif s[0] == "tick":
            live.record(None, tick=True)
        elif s[0] == "route":
            live.route(f"k{routed}", s[1])
            routed += 1
        else:
            live.free(f"k{s[1]}")
    return live


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, min_size=1, max_size=30), st.lists(st.integers(1, 700), min_size=30, max_size=30))
@example(  # issue 25: k1 never freed on 20; 20 expires and comes back; k2
    [("publish", 20, False, 4), ("publish", 21, False, 2), ("route", 0), ("tick",), ("publish", 21, False, 0),
     ("tick",), ("publish", 20, True, 4), ("route", 0)],
    [1, 1, 1, 600, 600, 600, 10, 10] + [1] * 22,
)
def test_replay_explains_what_the_live_router_computed(steps: list[tuple[Any, ...]], gaps: list[int]) -> None:
    live = run(steps, gaps)
    for rid, expected in live.explained.items():
        assert by_worker(replayed(live, rid)) == by_worker(expected), rid


def test_expired_workers_requests_are_not_load_after_it_returns() -> None:
    steps = [("publish", 20, False, 4), ("route", 0), ("tick",), ("publish", 20, True, 4), ("route", 0)]
    live = run(steps, [1, 1, 2 * LEASE_MS, 10, 10])
    assert live.fold.counters["worker_expired"] == 1
    assert [c["active_requests"] for c in by_worker(live.explained["k1"])] == [0]
    assert by_worker(replayed(live, "k1")) == by_worker(live.explained["k1"])
