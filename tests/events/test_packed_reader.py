"""The compiled reader of v1 EventBatch messages (kvstream._native.EventBatchReader)
against the generic path it stands in for (strict walk, fastavro, the model's checks).

On any bytes, ``EventCodec.decode`` (reader first) and ``EventCodec._decode_generic``
must give the same batch or the same DecodeError (message and reason). Where the reader
takes a message, what it gives must be exactly the generic batch: ids, offsets of the
packed hashes, and each event's digest (tests/events/digest.py's, the fold's). The
fold's form of any message (``EventCodec.read_packed``) is that batch too, in v1 bytes,
or that error.
"""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvstream.events.codec import HEADER_LEN, MARKER, PACKED_KINDS, PACKED_TIERS, EventCodec, unpack_u64
from kvstream.events.errors import DecodeError
from kvstream.events.model import Cleared, EventBatch, Removed, Stored, Tier

from .digest import event_digest
from .strategies import event_batches
from .test_avro_oracle import CRAFTED
from .test_codec import FP, event_body, message, zigzag

CODEC = EventCodec()
READ = CODEC._reader.read  # the compiled reader alone (None where it leaves a message)


def outcome(decode: Any, data: bytes) -> Any:
    try:
        return decode(data)
    except DecodeError as exc:
        return ("DecodeError", str(exc), exc.reason)


def assert_same(data: bytes) -> None:
    fast = outcome(CODEC.decode, data)
    generic = outcome(CODEC._decode_generic, data)
    assert fast == generic
    packed = READ(data)
    if packed is not None:
        assert isinstance(generic, EventBatch)
        assert_packed_is(data, packed, generic)
    # The fold's form (read_packed): the same batch in v1 bytes, or the same error.
    try:
        form, packed = CODEC.read_packed(data)
    except DecodeError as exc:
        assert ("DecodeError", str(exc), exc.reason) == generic
    else:
        assert isinstance(generic, EventBatch)
        assert_packed_is(form, packed, generic)
        assert (form is data) == (READ(data) is not None)  # a v1 message is not copied


def assert_packed_is(data: bytes, packed: Any, batch: EventBatch) -> None:
    """The packed form says exactly what ``batch`` holds."""
    worker_id, epoch, lease_ms, events = packed
    assert (worker_id, epoch, lease_ms) == (batch.worker_id, batch.epoch, batch.lease_ms)
    assert len(events) == len(batch.events)
    for (kind, rank, tier, eid, parent, blocks_at, tokens_at, n, digest), ev in zip(events, batch.events):
        assert PACKED_KINDS[kind] is type(ev)
        assert (rank, PACKED_TIERS[tier], eid) == (ev.dp_rank, ev.tier, ev.event_id)
        assert digest == event_digest(ev)
        if type(ev) is Cleared:
            assert (parent, n) == (None, 0)
            continue
        assert unpack_u64(data[blocks_at : blocks_at + 8 * n]) == ev.block_hashes
        if type(ev) is Stored:
            assert parent == ev.parent_hash
            assert unpack_u64(data[tokens_at : tokens_at + 8 * n]) == ev.tokens_hashes


@given(event_batches(max_events=6))
@settings(max_examples=300, deadline=None)
def test_reader_takes_every_encoded_batch(batch: EventBatch) -> None:
    data = CODEC.encode(batch)
    packed = READ(data)
    assert packed is not None  # the common record never falls back
    assert_packed_is(data, packed, batch)
    assert CODEC.decode(data) == CODEC._decode_generic(data) == batch


@st.composite
def valid_messages(draw: st.DrawFn) -> bytes:
    return CODEC.encode(draw(event_batches(max_events=3)))


@given(valid_messages(), st.data())
@settings(max_examples=400, deadline=None)
def test_bit_flips_decode_alike(valid: bytes, data: st.DataObject) -> None:
    flipped = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 3))):
        bit = data.draw(st.integers(0, len(valid) * 8 - 1))
        flipped[bit // 8] ^= 1 << (bit % 8)
    assert_same(bytes(flipped))


@given(valid_messages(), st.data())
@settings(max_examples=300, deadline=None)
def test_byte_overwrites_decode_alike(valid: bytes, data: st.DataObject) -> None:
    """0xff and 0x80 start and continue long varints; 0x01/0x03 are negative indexes."""
    mutated = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(HEADER_LEN, len(valid) - 1))
        mutated[pos] = data.draw(st.sampled_from([0x00, 0x01, 0x03, 0x08, 0x10, 0x7F, 0x80, 0xFF]))
    assert_same(bytes(mutated))


@given(valid_messages(), st.data())
@settings(max_examples=200, deadline=None)
def test_truncations_and_extensions_decode_alike(valid: bytes, data: st.DataObject) -> None:
    assert_same(valid[: data.draw(st.integers(0, len(valid) - 1))])
    assert_same(valid + data.draw(st.binary(min_size=1, max_size=8)))


@given(st.binary(max_size=300))
@example(b"")
@example(MARKER + FP)
@settings(max_examples=400, deadline=None)
def test_random_bodies_decode_alike(body: bytes) -> None:
    assert_same(MARKER + FP + body)
    assert_same(body)


def test_crafted_cases_decode_alike() -> None:
    """The strict walk's cases (issue 15), and layouts the reader leaves to the generic
    path: a sized (negative-count) array block, UNKNOWN symbols, a bad union index,
    hashes not a multiple of 8, stored-only fields on other kinds."""
    cases = [
        *CRAFTED,
        message(event_body(tier=4)),
        message(event_body(kind=3)),
        message(event_body(parent=2**63)),
        message(event_body()[:4] + zigzag(2) + event_body()[5:]),  # union index 2
        message(event_body(dp_rank=2**32)),
        message(event_body(dp_rank=-1)),
        message(event_body(blocks=b"\x01" * 12, tokens=b"\x02" * 12)),
        message(event_body(blocks=b"", tokens=b"")),
        message(event_body(kind=1)),  # REMOVED with tokens hashes
        message(event_body(kind=2)),  # CLEARED with hashes
        message(event_body(), event_body(), count=2),
        MARKER + FP + zigzag(7) + zigzag(1) + zigzag(-5) + zigzag(0),  # negative lease
    ]
    for data in cases:
        assert_same(data)
    # A sized block is valid Avro the reader leaves to the generic path.
    assert READ(CRAFTED[-1]) is None and isinstance(CODEC.decode(CRAFTED[-1]), EventBatch)


def test_digests_do_not_change() -> None:
    """Snapshots keep the digests: these values (CPython's tuple hash of the fields, as
    stored since the digest was introduced) must hold in every later version, computed
    by the compiled reader as by the Python reference."""
    cases = [
        (Stored(7, 1, Tier.HOST_PINNED, 3, 9, None, (1, 2**64 - 1), (5, 6)), -7926553023559663288),
        (Stored(2**64 - 1, 0, Tier.DEVICE, 2**63, 1, 2**61 - 1, (3,), (4,)), -6168629874250071638),
        (Removed(7, 2, Tier.DISK, 3, 10, (1,)), -1731718830003482222),
        (Cleared(7, 0, Tier.EXTERNAL, 3, 11), 3496647143410139544),
    ]
    for ev, digest in cases:
        assert event_digest(ev) == digest
        _, packed = CODEC.read_packed(CODEC.encode(EventBatch(ev.worker_id, ev.epoch, 0, (ev,))))
        assert packed[3][0][8] == digest
