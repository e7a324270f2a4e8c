"""The worker registry's record and fold, without a broker: the schema against Apache's
reference decoder, the fold's last-record-wins rule against a reference model, and every
kind of poison record counted and skipped."""

from __future__ import annotations

import io

import avro.io
import avro.schema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.events.codec import HEADER_LEN, AvroCodec
from kvstream.events.wire import worker_key
from kvstream.gateway.errors import RegistrationError
from kvstream.gateway.registry import (
    WORKER_REGISTRATION,
    Registration,
    RegistrationCodec,
    WorkerRegistry,
)

CODEC = RegistrationCodec()
U64 = (1 << 64) - 1

names = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1, max_size=12).filter(lambda s: s == s.strip())
registrations = st.builds(
    Registration,
    worker_id=st.integers(0, U64),
    url=st.one_of(st.none(), st.sampled_from(["http://127.0.0.1:8000", "https://w.example:443/base", "http://[::1]:9"])),
    models=st.lists(names, max_size=3, unique=True).map(tuple),
    loras=st.lists(names, max_size=3, unique=True).map(tuple),
    block_size=st.integers(1, 1 << 20),
    dp_ranks=st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=4, unique=True).map(tuple),
    engine=st.sampled_from(["vllm", "sglang", "zmq", "synthetic"]),
    kv_capacity_blocks=st.one_of(st.none(), st.integers(0, 1 << 62)),
    epoch=st.integers(0, U64),
    registered_at_ms=st.integers(0, 1 << 50),
)


def _reference(data: bytes) -> dict:
    """The record as Apache Avro's reference decoder reads it."""
    sv = AvroCodec().store.current(WORKER_REGISTRATION)
    assert data[2:HEADER_LEN] == sv.fingerprint
    schema = avro.schema.parse(sv.path.read_text())
    body = io.BytesIO(data[HEADER_LEN:])
    record = avro.io.DatumReader(schema, schema).read(avro.io.BinaryDecoder(body))
    assert body.tell() == len(data) - HEADER_LEN
    return record


@settings(max_examples=200, deadline=None)
@given(registrations)
def test_round_trip_and_the_reference_decoder_agree(reg: Registration) -> None:
    data = CODEC.encode(reg)
    assert CODEC.decode(data) == reg
    ref = _reference(data)
    assert ref["worker_id"] & U64 == reg.worker_id and ref["epoch"] & U64 == reg.epoch
    assert (ref["url"], tuple(ref["models"]), tuple(ref["loras"])) == (reg.url, reg.models, reg.loras)
    assert (ref["block_size"], tuple(ref["dp_ranks"]), ref["engine"]) == (reg.block_size, reg.dp_ranks, reg.engine)
    assert (ref["kv_capacity_blocks"], ref["registered_at_ms"]) == (reg.kv_capacity_blocks, reg.registered_at_ms)


def test_endpoint_of_a_registration() -> None:
    reg = Registration(5, "http://127.0.0.1:8000/", ("m",), ("a",), 16, (2, 3), "vllm", 100, 9, 1)
    ep = reg.endpoint()
    assert ep is not None and ep.url == "http://127.0.0.1:8000"  # trailing slash dropped
    assert (ep.worker_id, ep.models, ep.loras, ep.dp_ranks, ep.kv_capacity_blocks) == (5, ("m",), ("a",), 2, 100)
    assert ep.serves("m") and ep.serves("a") and not ep.serves("b")
    assert Registration(5, None, (), (), 16, (0,), "synthetic", None, 9, 1).endpoint() is None


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"url": "ftp://h:1"}, "http"),
        ({"url": "http://:80"}, "http"),
        ({"url": "http://h:99999"}, "port"),
        ({"url": "http://h:1/?q=1"}, "query"),
        ({"models": ("",)}, "model name"),
        ({"models": (" m",)}, "model name"),
        ({"block_size": 0}, "block_size"),
        ({"dp_ranks": ()}, "dp_ranks"),
        ({"dp_ranks": (1, 1)}, "dp_ranks"),
        ({"kv_capacity_blocks": -1}, "negative"),
    ],
)
def test_bad_registrations_are_refused(fields: dict, match: str) -> None:
    base = dict(worker_id=1, url="http://h:1", models=("m",), loras=(), block_size=16, dp_ranks=(0,),
                engine="vllm", kv_capacity_blocks=None, epoch=1, registered_at_ms=1)
    with pytest.raises(RegistrationError, match=match):
        Registration(**{**base, **fields})


def _reg(wid: int, url: str = "http://127.0.0.1:1", epoch: int = 1) -> Registration:
    return Registration(wid, url, (f"model-{wid}",), (), 16, (0,), "vllm", None, epoch, 0)


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
        value = None if epoch is None else CODEC.encode(_reg(wid, epoch=epoch))
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
    assert [ep.worker_id for ep in full.endpoints()] == sorted(model)
    assert all(full.endpoint(w) is not None for w in model)


def test_poison_records_are_counted_and_skipped() -> None:
    reg = WorkerRegistry()
    good = CODEC.encode(_reg(1))
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
    assert reg.endpoints() == () and reg.endpoint(1) is None


@st.composite
def hostile_records(draw) -> tuple[bytes | None, bytes | None]:
    """Random keys and values: bytes, truncated or bit-flipped registrations, tombstones."""
    key = draw(st.one_of(st.none(), st.binary(max_size=10), st.integers(0, 3).map(worker_key)))
    valid = CODEC.encode(_reg(draw(st.integers(0, 3))))
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
