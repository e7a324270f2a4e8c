"""The worker registry's fold (kvstream.replica.registry) without a broker: its
last-record-wins rule against a reference model and compaction, and every kind of
poison record counted and skipped."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.events.codec import AvroCodec
from kvstream.events.registration import WORKER_REGISTRATION, RegistrationCodec
from kvstream.events.wire import worker_key
from kvstream.replica.registry import WorkerRegistry
from tests.events.strategies import registration

CODEC = RegistrationCodec()


# One step of a workers-topic history: (worker id, registration epoch or None = tombstone).
steps = st.lists(st.tuples(st.integers(0, 5), st.one_of(st.none(), st.integers(1, 3))), max_size=40)


@settings(max_examples=200, deadline=None)
@given(steps)
def test_fold_keeps_the_last_record_of_each_key_as_compaction_does(history: list) -> None:
    """The fold of the whole history equals the fold of what compaction keeps (the last
    record of each key, tombstones included), and the model's view."""
    full, compacted = WorkerRegistry(), WorkerRegistry()
    model: dict[int, int] = {}
    last: dict[int, bytes | None] = {}
    for wid, epoch in history:
        value = None if epoch is None else CODEC.encode(registration(wid, epoch=epoch))
        full.apply(worker_key(wid), value)
        last[wid] = value
        if epoch is None:
            model.pop(wid, None)
        else:
            model[wid] = epoch
    for wid, value in last.items():
        compacted.apply(worker_key(wid), value)
    got = {w: r.epoch for w, r in full.registrations().items()}
    assert got == model == {w: r.epoch for w, r in compacted.registrations().items()}
    assert list(full.registrations()) == sorted(model)  # in id order
    assert full.worker_ids() == set(model) and all(full.registration(w) is not None for w in model)


def test_poison_records_are_counted_and_skipped() -> None:
    reg = WorkerRegistry()
    good = CODEC.encode(registration(1))
    assert reg.apply(worker_key(1), good) is None
    poison = [
        (None, good, "bad_key"),
        (b"\x00\x01", good, "bad_key"),
        (worker_key(2), good, "wrong_key"),  # worker 1's record under worker 2's key
        (worker_key(1), b"not avro at all", "undecodable"),
        (worker_key(1), good[:-3], "undecodable"),
        (worker_key(1), AvroCodec().encode("kvstream.control.ResyncRequest", {
            "worker_id": 1, "requester": "x", "reason": "y", "requested_at_ms": 0}), "undecodable"),
        (worker_key(3), None, "unknown_tombstone"),
    ]
    bad_url = AvroCodec().encode(WORKER_REGISTRATION, {
        "worker_id": 4, "url": "gopher://h", "models": ["m"], "loras": [], "block_size": 16, "dp_ranks": [0],
        "engine": "vllm", "kv_capacity_blocks": None, "epoch": 1, "registered_at_ms": 0})
    poison.append((worker_key(4), bad_url, "invalid"))
    for key, value, reason in poison:
        assert reg.apply(key, value) == reason
    assert {w: r.url for w, r in reg.registrations().items()} == {1: "http://127.0.0.1:1"}
    assert reg.skipped == {"bad_key": 2, "wrong_key": 1, "undecodable": 3, "unknown_tombstone": 1, "invalid": 1}
    assert reg.apply(worker_key(1), None) is None  # a tombstone of a known key removes it
    assert reg.registrations() == {} and reg.registration(1) is None and reg.worker_ids() == set()


@st.composite
def hostile_records(draw) -> tuple[bytes | None, bytes | None]:
    """Random keys and values: bytes, truncated or bit-flipped registrations, tombstones."""
    key = draw(st.one_of(st.none(), st.binary(max_size=10), st.integers(0, 3).map(worker_key)))
    valid = CODEC.encode(registration(draw(st.integers(0, 3))))
    kind = draw(st.sampled_from(["bytes", "flip", "cut", "none", "valid"]))
    if kind == "bytes":
        return key, draw(st.binary(max_size=80))
    if kind == "flip":
        i = draw(st.integers(0, len(valid) - 1))
        return key, valid[:i] + bytes([valid[i] ^ draw(st.integers(1, 255))]) + valid[i + 1:]
    if kind == "cut":
        return key, valid[: draw(st.integers(0, len(valid) - 1))]
    return key, None if kind == "none" else valid


@settings(max_examples=300, deadline=None)
@given(st.lists(hostile_records(), max_size=30))
def test_any_record_is_applied_or_counted_never_raised(records: list) -> None:
    reg = WorkerRegistry()
    for key, value in records:
        reason = reg.apply(key, value)
        assert reason is None or reason in {"bad_key", "undecodable", "invalid", "wrong_key", "unknown_tombstone"}
    assert reg.applied + sum(reg.skipped.values()) == len(records)
    for wid, r in reg.registrations().items():  # whatever was kept is a valid registration of its key
        assert r.worker_id == wid and CODEC.decode(CODEC.encode(r)) == r
