"""EventCodec / AvroCodec: single-object framing, round trips, and hostile input."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstream.events.codec import EVENT_BATCH, HEADER_LEN, MARKER, AvroCodec, EventCodec, pack_u64, unpack_u64
from kvstream.events.errors import DecodeError, EncodeError
from kvstream.events.model import U64_MAX, Cleared, EventBatch, Removed, Stored, Tier
from kvstream.events.schemas import SchemaStore
from .strategies import event_batches

CODEC = EventCodec()
AVRO = CODEC.codec
FP = AVRO.fingerprint(EVENT_BATCH)
W = U64_MAX  # a worker id with the top bit set: negative on the wire


def zigzag(n: int) -> bytes:
    """Avro's variable-length zigzag long, written independently of fastavro; any
    Python int, so that out-of-range and non-canonical values can be crafted."""
    z = (n << 1) ^ (n >> 63) if -(1 << 63) <= n < (1 << 63) else n * 2
    out = bytearray()
    while True:
        byte, z = z & 0x7F, z >> 7
        if z:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def avro_bytes(b: bytes) -> bytes:
    return zigzag(len(b)) + b


def event_body(
    *,
    dp_rank: int = 0,
    tier: int = 0,
    event_id: int = 1,
    kind: int = 0,
    parent: int | None = None,
    blocks: bytes = pack_u64((1, 2)),
    tokens: bytes = pack_u64((3, 4)),
) -> bytes:
    """The Avro encoding of one v1 Event record (enum fields by index)."""
    union = zigzag(0) if parent is None else zigzag(1) + zigzag(parent)
    return (
        zigzag(dp_rank)
        + zigzag(tier)
        + zigzag(event_id)
        + zigzag(kind)
        + union
        + avro_bytes(blocks)
        + avro_bytes(tokens)
    )


def message(*events: bytes, worker: int = 7, epoch: int = 1, lease: int = 1000, count: int | None = None) -> bytes:
    n = len(events) if count is None else count
    array = (zigzag(n) + b"".join(events) + zigzag(0)) if events or count else zigzag(0)
    return MARKER + FP + zigzag(worker) + zigzag(epoch) + zigzag(lease) + array


def stored(eid: int, n: int = 16, parent: int | None = None, tier: Tier = Tier.DEVICE) -> Stored:
    return Stored(W, 0, tier, 3, eid, parent, tuple(range(eid, eid + n)), tuple(range(n)))


def sample_batch() -> EventBatch:
    return EventBatch(
        W,
        3,
        10_000,
        (
            stored(1),
            stored(2, parent=U64_MAX, tier=Tier.HOST_PINNED),
            Removed(W, 1, Tier.DISK, 3, 3, (0, U64_MAX)),
            Cleared(W, 2, Tier.EXTERNAL, 3, 4),
        ),
    )


# --- framing and round trips ---------------------------------------------------------------


def test_single_object_header() -> None:
    data = CODEC.encode(sample_batch())
    assert data[:2] == b"\xc3\x01"
    assert data[2:HEADER_LEN] == FP == AVRO.store.current(EVENT_BATCH).fingerprint
    assert len(FP) == 8


def test_handcrafted_body_decodes() -> None:
    """Our independent encoding of the v1 layout is what the codec reads: packed hashes
    are little-endian u64 and u64 ids travel as the two's-complement long."""
    data = message(
        event_body(parent=-1, blocks=struct.pack("<2Q", 1, 2**64 - 1), tokens=bytes(16)),
        worker=-1,
        epoch=2,
    )
    batch = CODEC.decode(data)
    assert batch == EventBatch(U64_MAX, 2, 1000, (Stored(U64_MAX, 0, Tier.DEVICE, 2, 1, U64_MAX, (1, U64_MAX), (0, 0)),))


def test_encoder_matches_handcrafted_layout() -> None:
    batch = EventBatch(7, 1, 1000, (Stored(7, 0, Tier.DEVICE, 1, 1, None, (1, 2), (3, 4)),))
    assert CODEC.encode(batch) == message(event_body())


def test_heartbeat_round_trip() -> None:
    batch = EventBatch(0, 0, 0, ())
    assert CODEC.decode(CODEC.encode(batch)) == batch


@given(event_batches())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_round_trip(batch: EventBatch) -> None:
    data = CODEC.encode(batch)
    assert CODEC.decode(data) == batch
    assert CODEC.decode(bytearray(data)) == batch
    assert CODEC.decode(memoryview(data)) == batch


@given(st.lists(st.integers(0, U64_MAX), max_size=300))
@settings(deadline=None)
def test_pack_unpack(values: list[int]) -> None:
    packed = pack_u64(values)
    assert packed == b"".join(v.to_bytes(8, "little") for v in values)
    assert unpack_u64(packed) == tuple(values)


def test_generic_codec_round_trip() -> None:
    record = {"worker_id": -5, "epoch": 0, "lease_ms": 1, "events": []}
    assert AVRO.decode(AVRO.encode(EVENT_BATCH, record)) == (EVENT_BATCH, record)


# --- encode errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch",
    [
        EventBatch(1 << 64, 0, 0, ()),
        EventBatch(-1, 0, 0, ()),
        EventBatch(0, 1 << 64, 0, ()),
        EventBatch(0, 0, -1, ()),
        EventBatch(0, 0, 1 << 63, ()),
        EventBatch(0, 0, 0, (Cleared(0, 1 << 32, Tier.DEVICE, 0, 0),)),
        EventBatch(0, 0, 0, (Cleared(0, -1, Tier.DEVICE, 0, 0),)),
        EventBatch(0, 0, 0, (Cleared(0, 0, Tier.DEVICE, 0, -1),)),
        EventBatch(0, 0, 0, (Removed(0, 0, Tier.DEVICE, 0, 0, (1 << 64,)),)),
        EventBatch(0, 0, 0, (Stored(0, 0, Tier.DEVICE, 0, 0, -1, (1,), (1,)),)),
        EventBatch(0, 0, 0, (Stored(0, 0, Tier.DEVICE, 0, 0, None, (1,), (-1,)),)),
        EventBatch(0, 0, 0, (Cleared(0, 0, None, 0, 0),)),  # type: ignore[arg-type]
        EventBatch("7", 0, 0, ()),  # type: ignore[arg-type]
        EventBatch(0, 0, 0, (Removed(0, 0, Tier.DEVICE, 0, 0, ("1",)),)),  # type: ignore[arg-type]
    ],
)
def test_encode_rejects_bad_values(batch: EventBatch) -> None:
    with pytest.raises(EncodeError):
        CODEC.encode(batch)


def test_generic_encode_rejects_bad_record() -> None:
    with pytest.raises(EncodeError, match="cannot encode"):
        AVRO.encode(EVENT_BATCH, {"worker_id": "seven", "epoch": 0, "lease_ms": 0, "events": []})
    with pytest.raises(EncodeError):
        AVRO.encode(EVENT_BATCH, {"worker_id": 0, "epoch": 0, "lease_ms": 0, "events": [{"tier": "NOPE"}]})


# --- decode errors -------------------------------------------------------------------------


def generic(events: list[dict[str, Any]], lease: int = 0) -> bytes:
    """A message written by the generic codec: well-formed Avro, possibly invalid events."""
    return AVRO.encode(EVENT_BATCH, {"worker_id": 1, "epoch": 1, "lease_ms": lease, "events": events})


def ev(**fields: Any) -> dict[str, Any]:
    base = {
        "dp_rank": 0,
        "tier": "DEVICE",
        "event_id": 1,
        "kind": "STORED",
        "parent_hash": None,
        "block_hashes": pack_u64((1,)),
        "tokens_hashes": pack_u64((2,)),
    }
    return {**base, **fields}


BAD: dict[str, tuple[bytes, str | None, str | None]] = {
    "empty": (b"", "truncated", "shorter than"),
    "header only": (MARKER + FP, "truncated", "ends too early"),
    "wrong marker": (b"\xc3\x02" + FP + b"\x00" * 4, "marker", "bad marker"),
    "json": (b'{"worker_id": 1, "events": []}', "marker", "bad marker"),
    "unknown fingerprint": (MARKER + b"\x01" * 8 + b"\x00" * 4, "fingerprint", "0101010101010101"),
    "trailing bytes": (message() + b"\x00", "malformed", "after the end"),
    "bytes length 2^60": (message(event_body()[:-17] + zigzag(1 << 60) + b"x" * 8), "truncated", "ends too early"),
    "negative bytes length": (message(event_body()[:-17] + zigzag(-8) + b"x" * 8), "malformed", "negative length -8"),
    "array count 2^60": (message(event_body(), count=1 << 60), "truncated", "ends too early"),
    # A negative count is followed by a block size; 2^63 items then run out of input.
    "array count -2^63": (message(event_body(), count=-(1 << 63)), None, "EventBatch body"),
    # Enum and union indexes out of range are refused as Apache Avro (Java) does, even
    # where a default exists: they are corruption, not a symbol from a newer schema.
    "enum index past end": (message(event_body(tier=9)), "malformed", r"enum kvstream.events.Tier: index 9 .* \[0, 5\)"),
    "negative enum index": (message(event_body(tier=-2)), "malformed", r"index -2 .* \[0, 5\)"),
    "negative kind index": (message(event_body(kind=-1)), "malformed", r"enum kvstream.events.Kind: index -1"),
    "union index past end": (message(event_body()[:4] + zigzag(5)), "malformed", r"union \[null, long\]: index 5"),
    "negative union index": (message(event_body()[:4] + zigzag(-1) + event_body()[5:]), "malformed", "index -1"),
    "11-byte varint": (message(b"\x80" * 10 + b"\x00" + event_body()[1:]), "malformed", "longer than 64 bits"),
    "10th varint byte past 64 bits": (message(b"\x80" * 9 + b"\x02" + event_body()[1:]), "malformed", "10th byte 0x02"),
    "unterminated varint": (MARKER + FP + b"\xff" * 5, "truncated", "ends too early"),
    "packed length 7": (message(event_body(blocks=b"\x00" * 7, tokens=b"\x00" * 8)), "invalid", "multiple of 8"),
    "negative lease": (generic([], lease=-1), "invalid", "negative lease_ms"),
    "dp_rank over u32": (generic([ev(dp_rank=1 << 32)]), "invalid", "dp_rank"),
    "negative dp_rank": (generic([ev(dp_rank=-1)]), "invalid", "dp_rank"),
    "tier UNKNOWN": (generic([ev(tier="UNKNOWN")]), "invalid", "tier UNKNOWN"),
    "kind UNKNOWN": (generic([ev(kind="UNKNOWN")]), "invalid", "kind UNKNOWN"),
    "count mismatch": (generic([ev(tokens_hashes=pack_u64((1, 2)))]), "invalid", "1 block hashes but 2"),
    "stored without blocks": (generic([ev(block_hashes=b"", tokens_hashes=b"")]), "invalid", "no blocks"),
    "removed with tokens": (generic([ev(kind="REMOVED")]), "invalid", "stored-only"),
    "removed with parent": (generic([ev(kind="REMOVED", parent_hash=5, tokens_hashes=b"")]), "invalid", "stored-only"),
    "removed without blocks": (generic([ev(kind="REMOVED", block_hashes=b"", tokens_hashes=b"")]), "invalid", "no blocks"),
    "cleared with blocks": (generic([ev(kind="CLEARED", tokens_hashes=b"")]), "invalid", "block hashes"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case: str) -> None:
    data, reason, text = BAD[case]
    with pytest.raises(DecodeError, match=text) as info:
        CODEC.decode(data)
    assert info.value.reason == reason or reason is None


def test_good_event_after_bad_one_is_not_returned() -> None:
    """A batch with one bad event is rejected whole: no half-built batch."""
    data = generic([ev(), ev(kind="UNKNOWN")])
    with pytest.raises(DecodeError, match="event 1"):
        CODEC.decode(data)


def test_not_bytes() -> None:
    with pytest.raises(DecodeError) as info:
        CODEC.decode("c301")  # type: ignore[arg-type]
    assert info.value.reason == "type"


def test_absurd_length_allocates_nothing_big() -> None:
    data = message(event_body()[:-17] + zigzag(1 << 40) + b"x" * 8)
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError):
            CODEC.decode(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


# --- fuzzing: only DecodeError may come out, and a success is a whole, valid batch ----------

VALID = [CODEC.encode(sample_batch()), CODEC.encode(EventBatch(5, 1, 0, ())), message(event_body(parent=9))]


def decode_or_decode_error(data: bytes) -> None:
    try:
        batch = CODEC.decode(data)
    except DecodeError as exc:
        assert exc.reason in DecodeError.REASONS and str(exc)
        return
    assert isinstance(batch, EventBatch)
    assert CODEC.decode(CODEC.encode(batch)) == batch


@given(st.binary(max_size=400))
@example(b"")
@example(MARKER + FP)
@settings(deadline=None)
def test_fuzz_random_bytes(data: bytes) -> None:
    decode_or_decode_error(data)


@given(st.binary(max_size=400))
@settings(deadline=None)
def test_fuzz_random_body_after_valid_header(body: bytes) -> None:
    decode_or_decode_error(MARKER + FP + body)


@given(st.sampled_from(VALID), st.data())
@settings(deadline=None)
def test_fuzz_truncations(valid: bytes, data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(valid) - 1))
    with pytest.raises(DecodeError):
        CODEC.decode(valid[:cut])


@given(st.sampled_from(VALID), st.data())
@settings(max_examples=500, deadline=None)
def test_fuzz_bit_flips(valid: bytes, data: st.DataObject) -> None:
    flipped = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 4))):
        bit = data.draw(st.integers(0, len(valid) * 8 - 1))
        flipped[bit // 8] ^= 1 << (bit % 8)
    decode_or_decode_error(bytes(flipped))


@given(st.sampled_from(VALID), st.data())
@settings(deadline=None)
def test_fuzz_byte_overwrites(valid: bytes, data: st.DataObject) -> None:
    """Whole bytes replaced by extremes: 0xff starts long varints, 0x80 continues them."""
    mutated = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(HEADER_LEN, len(valid) - 1))
        mutated[pos] = data.draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF]))
    decode_or_decode_error(bytes(mutated))


GENERIC = {
    "type": "record",
    "name": "Mixed",
    "namespace": "kvstream.test",
    "fields": [
        {"name": "s", "type": "string"},
        {"name": "m", "type": {"type": "map", "values": "long"}},
        {"name": "xs", "type": {"type": "array", "items": "long"}},
    ],
}


@pytest.mark.parametrize(
    "body",
    [
        zigzag(1 << 60) + b"abc",  # string length
        zigzag(1) + b"a" + zigzag(1 << 60) + b"\x02k\x02",  # map entry count
        zigzag(1) + b"a" + zigzag(0) + zigzag(1 << 60) + b"\x02",  # array item count
        zigzag(1) + b"a" + zigzag(0) + zigzag(-(1 << 60)) + zigzag(1 << 60) + b"\x02",  # blocked array
        zigzag(2) + b"\xff\xfe" + zigzag(0) + zigzag(0),  # not UTF-8
    ],
)
def test_generic_records_stay_bounded_on_hostile_input(tmp_path: Path, body: bytes) -> None:
    (tmp_path / "kvstream.test.Mixed").mkdir()
    (tmp_path / "kvstream.test.Mixed" / "v1.avsc").write_text(json.dumps(GENERIC))
    codec = AvroCodec(SchemaStore(tmp_path))
    good = codec.encode("kvstream.test.Mixed", {"s": "é", "m": {"k": -1}, "xs": [1, 2]})
    assert codec.decode(good) == ("kvstream.test.Mixed", {"s": "é", "m": {"k": -1}, "xs": [1, 2]})
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError):
            codec.decode(MARKER + codec.fingerprint("kvstream.test.Mixed") + body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


LIVE_FINGERPRINTS = [sv.fingerprint for sv in AVRO.store.all_versions()]


@given(st.sampled_from(LIVE_FINGERPRINTS), st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_fuzz_every_live_schema(fp: bytes, body: bytes) -> None:
    """Whatever records later issues add, the generic decoder only raises DecodeError."""
    try:
        name, record = AVRO.decode(MARKER + fp + body)
    except DecodeError:
        return
    assert {sv.fingerprint: sv.name for sv in AVRO.store.all_versions()}[fp] == name
    assert isinstance(record, dict)


# --- the compiled writer against the generic one ------------------------------------------


@given(event_batches())
@settings(max_examples=300, deadline=None)
def test_compiled_writer_writes_the_generic_bytes(batch: EventBatch) -> None:
    assert CODEC._fast
    assert CODEC._encode_fast(batch) == CODEC._encode_generic(batch)


def test_compiled_writer_refusals_get_the_generic_errors() -> None:
    """Values the compiled writer cannot take fall back to the generic path, which names
    the field; a pinned or other schema version never uses the compiled writer."""
    for bad, text in (
        (EventBatch(1, 1, 0, (Cleared(1, 1 << 32, Tier.DEVICE, 1, 1),)), "dp_rank"),
        (EventBatch(1, 1, -1, ()), "lease_ms"),
    ):
        with pytest.raises(EncodeError, match=text):
            CODEC.encode(bad)
    other = EventCodec(AvroCodec(SchemaStore(Path(__file__).parent / "data" / "schemas")))
    assert not other._fast
