"""The strict decoder against Apache Avro's reference Python decoder (``avro`` 1.12.2).

For random, bit-flipped and overwritten bytes, both decoders must either refuse a
message or agree on its value. Values are compared after mapping the reference's
record through our event model (kvstream's own checks apply to both sides), so a
difference can only come from the Avro layer.

The reference maps an enum index past the writer's symbols to the enum's default
(``UNKNOWN``); Avro's Java decoder, and ours, refuse it. The model refuses ``UNKNOWN`` on a tier or kind, so at the model level
the two agree; at the record level (the generic codec) a value holding ``UNKNOWN``
counts as refused on either side.
"""

from __future__ import annotations

import io
from typing import Any

import avro.io
import avro.schema
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvstream.events.codec import EVENT_BATCH, HEADER_LEN, MARKER, EventCodec
from kvstream.events.errors import DecodeError
from kvstream.events.model import EventBatch

from .strategies import event_batches
from .test_codec import FP, event_body, message, zigzag

CODEC = EventCodec()
AVRO = CODEC.codec
REFUSED = "refused"


def _reference_readers() -> dict[bytes, tuple[str, avro.io.DatumReader]]:
    out = {}
    for sv in AVRO.store.all_versions():
        writer = avro.schema.parse(sv.path.read_text())
        reader = avro.schema.parse(AVRO.store.current(sv.name).path.read_text())
        out[sv.fingerprint] = (sv.name, avro.io.DatumReader(writer, reader))
    return out


REFERENCE = _reference_readers()


def _has_unknown(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_unknown(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_unknown(v) for v in value)
    return value == "UNKNOWN"


def reference_record(data: bytes) -> tuple[str, dict[str, Any]] | str:
    """What the reference decodes a single-object message to, or REFUSED."""
    if len(data) < HEADER_LEN or data[:2] != MARKER or data[2:HEADER_LEN] not in REFERENCE:
        return REFUSED
    name, reader = REFERENCE[data[2:HEADER_LEN]]
    body = io.BytesIO(data[HEADER_LEN:])
    try:
        record = reader.read(avro.io.BinaryDecoder(body))
    except Exception:  # the reference signals bad input with assorted exception types
        return REFUSED
    if body.tell() != len(data) - HEADER_LEN or _has_unknown(record):
        return REFUSED  # trailing bytes: not one single-object message
    return name, record


def ours_record(data: bytes) -> tuple[str, dict[str, Any]] | str:
    try:
        got = AVRO.decode(data)
    except DecodeError:
        return REFUSED
    return REFUSED if _has_unknown(got[1]) else got


def reference_batch(data: bytes) -> EventBatch | str:
    """The reference's record mapped through our event model, or REFUSED."""
    got = reference_record(data)
    if got == REFUSED or got[0] != EVENT_BATCH:
        return REFUSED
    try:
        return EventCodec._batch(got[1])
    except (DecodeError, ValueError):
        return REFUSED


def ours_batch(data: bytes) -> EventBatch | str:
    try:
        return CODEC.decode(data)
    except DecodeError:
        return REFUSED


def assert_agree(data: bytes) -> None:
    assert ours_batch(data) == reference_batch(data)
    assert ours_record(data) == reference_record(data)


# The cases issue 15 found: a negative tier index, a negative union index, an 11-byte
# varint, a 10th varint byte past 64 bits; and their in-range neighbours.
CRAFTED = [
    message(event_body(tier=-2)),
    message(event_body(tier=3)),
    message(event_body(kind=-1)),
    message(event_body()[:4] + zigzag(-1) + event_body()[5:]),
    message(b"\x80" * 10 + b"\x00" + event_body()[1:]),
    message(b"\x80" * 9 + b"\x02" + event_body()[1:]),
    message(b"\x80" * 9 + b"\x01" + event_body()[1:]),  # a 10-byte varint: valid Avro
    message(b"\x80\x00" + event_body()[1:]),  # non-minimal but in range: valid
    # A negative block count, then the block's size in bytes.
    MARKER + FP + zigzag(7) + zigzag(1) + zigzag(1000) + zigzag(-1) + zigzag(len(event_body())) + event_body() + zigzag(0),
]


@st.composite
def valid_messages(draw: st.DrawFn) -> bytes:
    return CODEC.encode(draw(event_batches(max_events=3)))


@given(valid_messages(), st.data())
@settings(max_examples=400, deadline=None)
def test_bit_flips_agree_with_reference(valid: bytes, data: st.DataObject) -> None:
    flipped = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 3))):
        bit = data.draw(st.integers(HEADER_LEN * 8, len(valid) * 8 - 1))
        flipped[bit // 8] ^= 1 << (bit % 8)
    assert_agree(bytes(flipped))


@given(valid_messages(), st.data())
@settings(max_examples=200, deadline=None)
def test_byte_overwrites_agree_with_reference(valid: bytes, data: st.DataObject) -> None:
    """0xff and 0x80 start and continue long varints; 0x01/0x03 are negative indexes."""
    mutated = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(HEADER_LEN, len(valid) - 1))
        mutated[pos] = data.draw(st.sampled_from([0x00, 0x01, 0x03, 0x7F, 0x80, 0xFF]))
    assert_agree(bytes(mutated))


@given(st.sampled_from(sorted(REFERENCE)), st.binary(max_size=200))
@example(FP, CRAFTED[0][HEADER_LEN:])
@settings(max_examples=400, deadline=None)
def test_random_bodies_agree_with_reference(fp: bytes, body: bytes) -> None:
    assert_agree(MARKER + fp + body)


def test_crafted_cases_agree_with_reference() -> None:
    outcomes = []
    for data in CRAFTED:
        assert_agree(data)
        outcomes.append(ours_record(data) != REFUSED)
    assert outcomes == [False, True, False, False, False, False, True, True, True]


@given(event_batches(max_events=4))
@settings(max_examples=100, deadline=None)
def test_valid_messages_decode_equal(batch: EventBatch) -> None:
    data = CODEC.encode(batch)
    assert ours_batch(data) == reference_batch(data) == batch
