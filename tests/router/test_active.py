"""Active sequences (DESIGN.md §6): load per worker, shared blocks once, expiry; the
Python reference model (tests/router/reference_router.py) and the compiled core
(kvstream.router.active) alike."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstream.events.codec import pack_u64
from kvstream.hashing import sequence_hashes
from kvstream.replica.active_codec import ActiveOpCodec
from kvstream.router.active import (
    ActiveSequences,
    AddRequest,
    FreeRequest,
    PackedHashes,
    PrefillDone,
    WorkerLoad,
)
from kvstream.router.errors import DuplicateRequestError, UnknownRequestError
from kvstream.router.index import WorkerKey

from .reference_router import ActiveSequences as ReferenceActiveSequences

W0, W1 = WorkerKey(1, 0), WorkerKey(1, 1)
CHAIN = tuple(sequence_hashes(list(range(100, 110))))  # 10 blocks
OTHER = tuple(sequence_hashes(list(range(200, 204))))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def add(rid: str, key: WorkerKey, isl: int, overlap: int, hashes: tuple[int, ...], ts: float) -> AddRequest:
    return AddRequest(rid, key.worker_id, key.dp_rank, isl, overlap, hashes, ts)



@pytest.fixture(params=[ReferenceActiveSequences, ActiveSequences], ids=["reference", "core"])
def Active(request: pytest.FixtureRequest) -> type:  # noqa: N802 (a class)
    return request.param

def test_load_counts_shared_blocks_once(Active: type) -> None:
    act = Active(clock=Clock())
    assert act.load(W0) is None
    act.apply(add("a", W0, 160, 32, CHAIN, 1000))
    act.apply(add("b", W0, 96, 0, CHAIN[:6], 1000))  # shares 6 blocks with a
    act.apply(add("c", W1, 64, 0, OTHER, 1000))
    assert act.load(W0) == WorkerLoad(prefill_tokens=128 + 96, decode_blocks=10, requests=2)
    assert act.load(W1) == WorkerLoad(64, 4, 1)
    act.apply(PrefillDone("a", 1001))
    assert act.load(W0) == WorkerLoad(96, 10, 2)
    act.apply(PrefillDone("a", 1002))  # again: nothing left to subtract
    assert act.load(W0) == WorkerLoad(96, 10, 2)
    act.apply(FreeRequest("a", 1003))
    assert act.load(W0) == WorkerLoad(96, 6, 1)
    act.apply(FreeRequest("b", 1003))
    assert act.load(W0) is None and "b" not in act and len(act) == 1


def new_blocks(act, key: WorkerKey, seq_hashes: tuple[int, ...]) -> int:
    """How many of ``seq_hashes`` (a prompt's chain) the worker does not hold yet."""
    return act.loads_for([key], seq_hashes)[0][4]


def test_new_blocks_is_what_the_request_adds(Active: type) -> None:
    act = Active(clock=Clock())
    assert new_blocks(act, W0, CHAIN) == 10
    act.apply(add("a", W0, 96, 0, CHAIN[:6], 1000))
    assert new_blocks(act, W0, CHAIN) == 4
    assert new_blocks(act, W0, CHAIN[:3]) == 0
    assert new_blocks(act, W0, OTHER) == 4
    assert new_blocks(act, W0, ()) == 0
    assert new_blocks(act, W1, CHAIN) == 10
    for cut in range(1, 10):
        act2 = Active(clock=Clock())
        act2.apply(add("x", W0, 16 * cut, 0, CHAIN[:cut], 1000))
        assert new_blocks(act2, W0, CHAIN) == 10 - cut


def test_expiry_after_ttl_with_an_injected_clock(Active: type) -> None:
    clock = Clock()
    act = Active(ttl_s=300, clock=clock)
    act.apply(add("old", W0, 32, 0, CHAIN[:2], 1000))
    act.apply(add("new", W0, 32, 0, CHAIN[:2], 1200))
    act.apply(add("gone", W1, 32, 0, OTHER, 1100))
    act.apply(FreeRequest("gone", 1150))
    clock.now = 1300
    assert act.expire() == []  # exactly 300 s is not older than 300 s
    clock.now = 1300.5
    assert act.expire() == ["old"]
    assert act.load(W0) == WorkerLoad(32, 2, 1)
    assert act.expire(now=1600) == ["new"]
    assert len(act) == 0 and act.load(W0) is None
    # A re-added id is not expired by the stale heap entry of its first life.
    act.apply(add("old", W0, 32, 0, CHAIN[:2], 1590))
    assert act.expire(now=1700) == []
    assert "old" in act


def test_bad_operations_are_refused_without_changing_state(Active: type) -> None:
    act = Active(clock=Clock())
    act.apply(add("a", W0, 32, 0, CHAIN[:2], 1000))
    with pytest.raises(DuplicateRequestError, match="'a' is already active"):
        act.apply(add("a", W1, 32, 0, OTHER, 1000))
    with pytest.raises(UnknownRequestError, match="free of request 'zz'"):
        act.apply(FreeRequest("zz", 1000))
    with pytest.raises(UnknownRequestError, match="prefill_done of request 'zz'"):
        act.apply(PrefillDone("zz", 1000))
    with pytest.raises(TypeError):
        act.apply("free a")  # type: ignore[arg-type]
    assert act.load(W0) == WorkerLoad(32, 2, 1) and act.load(W1) is None
    with pytest.raises(ValueError, match="ttl_s"):
        Active(ttl_s=0)


def test_remove_worker_drops_its_requests(Active: type) -> None:
    act = Active(clock=Clock())
    act.apply(add("a", W0, 32, 0, CHAIN[:2], 1000))
    act.apply(add("b", W1, 32, 0, OTHER, 1000))
    act.apply(add("c", WorkerKey(2, 0), 32, 0, OTHER, 1000))
    assert sorted(act.remove_worker(1)) == ["a", "b"]
    assert act.load(W0) is None and act.load(W1) is None and len(act) == 1


@given(st.lists(st.integers(0, 2**64 - 1), max_size=40), st.lists(st.integers(0, 2**64 - 1), max_size=40))
def test_packed_hashes_are_the_tuple_of_their_ints(a: list[int], b: list[int]) -> None:
    pa = PackedHashes(pack_u64(a))
    assert (len(pa), list(pa), pa[::-1], pa == tuple(a), tuple(a) == pa) == (len(a), a, tuple(a[::-1]), True, True)
    assert hash(pa) == hash(tuple(a))
    assert (pa == tuple(b)) == (a == b) == (pa == PackedHashes(pack_u64(b)))
    assert pa != a  # a list is not a tuple, as for tuples
    if a:
        assert (pa[0], pa[-1]) == (a[0], a[-1])
    # An op holding packed hashes goes through the kvstream.active record unchanged.
    op = AddRequest("replica-1/r", 1, 0, 16 * len(a), 0, pa, 1000.0)
    codec = ActiveOpCodec()
    assert codec.decode(codec.encode("replica-1", op)) == ("replica-1", op)


def test_packed_hashes_of_a_partial_word_are_rejected() -> None:
    with pytest.raises(ValueError, match="not a multiple of 8"):
        PackedHashes(b"\x00" * 12)


def test_packed_and_tuple_ops_load_alike(Active: type) -> None:  # noqa: N803
    loads = []
    for hashes in (CHAIN, PackedHashes(pack_u64(CHAIN))):
        active = Active(clock=Clock())
        active.apply(add("a", W0, 160, 0, hashes, 1000.0))
        active.apply(add("b", W0, 64, 0, OTHER, 1000.0))
        active.apply(FreeRequest("b", 1001.0))
        loads.append((active.load(W0), active.loads_for([W0], CHAIN[:3] + OTHER[:1])))
    assert loads[0] == loads[1] == [(WorkerLoad(160, 10, 1), [(True, 160, 10, 1, 1)])][0]
