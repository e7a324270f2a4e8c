"""Hypothesis strategies for router events (u64 extremes are drawn often on purpose) and
worker registrations."""

from __future__ import annotations

from hypothesis import strategies as st

from kvstream.events.model import U64_MAX, Cleared, EventBatch, Removed, Stored, Tier
from kvstream.events.registration import Registration
from kvstream.roles import Handoff, Role

u64 = st.one_of(st.sampled_from([0, 1, (1 << 63) - 1, 1 << 63, U64_MAX]), st.integers(0, U64_MAX))
u32 = st.one_of(st.sampled_from([0, (1 << 32) - 1]), st.integers(0, (1 << 32) - 1))
tiers = st.sampled_from(list(Tier))


@st.composite
def event_batches(draw: st.DrawFn, max_events: int = 8) -> EventBatch:
    worker_id, epoch = draw(u64), draw(u64)
    events = []
    for _ in range(draw(st.integers(0, max_events))):
        kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
        common = dict(worker_id=worker_id, dp_rank=draw(u32), tier=draw(tiers), epoch=epoch, event_id=draw(u64))
        if kind == "stored":
            n = draw(st.integers(1, 20))
            events.append(
                Stored(
                    **common,
                    parent_hash=draw(st.none() | u64),
                    block_hashes=tuple(draw(st.lists(u64, min_size=n, max_size=n))),
                    tokens_hashes=tuple(draw(st.lists(u64, min_size=n, max_size=n))),
                )
            )
        elif kind == "removed":
            events.append(Removed(**common, block_hashes=tuple(draw(st.lists(u64, min_size=1, max_size=20)))))
        else:
            events.append(Cleared(**common))
    lease_ms = draw(st.one_of(st.just(0), st.just((1 << 63) - 1), st.integers(0, 10**7)))
    return EventBatch(worker_id, epoch, lease_ms, tuple(events))


names = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1, max_size=12).filter(lambda s: s == s.strip())
ports = st.integers(1, 65535)
#: (role, handoff, bootstrap_port) as kvstream.events.registration.check_role allows them.
roles = st.one_of(
    st.just((Role.BOTH, None, None)),
    st.tuples(st.sampled_from([Role.PREFILL, Role.DECODE]), st.just(Handoff.NIXL), st.none()),
    st.tuples(st.just(Role.PREFILL), st.just(Handoff.BOOTSTRAP), ports),
    st.tuples(st.just(Role.DECODE), st.just(Handoff.BOOTSTRAP), st.one_of(st.none(), ports)),
)
#: Registrations of kvstream.workers (kvstream.events.registration), each field over its range.
registrations = roles.flatmap(lambda role: st.builds(
    Registration,
    worker_id=st.integers(0, U64_MAX),
    url=st.one_of(st.none(), st.sampled_from(["http://127.0.0.1:8000", "https://w.example:443/base", "http://[::1]:9"])),
    models=st.lists(names, max_size=3, unique=True).map(tuple),
    loras=st.lists(names, max_size=3, unique=True).map(tuple),
    block_size=st.integers(1, 1 << 20),
    dp_ranks=st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=4, unique=True).map(tuple),
    engine=st.sampled_from(["vllm", "sglang", "zmq", "synthetic"]),
    kv_capacity_blocks=st.one_of(st.none(), st.integers(0, 1 << 62)),
    epoch=st.integers(0, U64_MAX),
    registered_at_ms=st.integers(0, 1 << 50),
    role=st.just(role[0]),
    handoff=st.just(role[1]),
    bootstrap_port=st.just(role[2]),
))


def registration(wid: int, url: str = "http://127.0.0.1:1", epoch: int = 1) -> Registration:
    """A routable registration of ``wid`` serving ``model-<wid>``."""
    return Registration(wid, url, (f"model-{wid}",), (), 16, (0,), "vllm", None, epoch, 0)
