"""u64 ids as Avro longs and as record keys (kvstream.events.wire), against struct's
own two's-complement and big-endian packing."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstream.events.codec import AvroCodec
from kvstream.events.control import RESYNC_REQUEST, ResyncRequest
from kvstream.events.errors import EncodeError
from kvstream.events.wire import key_worker, to_long, to_u64, worker_key

u64s = st.integers(0, (1 << 64) - 1)


@given(u64s)
def test_long_is_the_same_64_bits(value: int) -> None:
    long = to_long(value)
    assert struct.pack(">q", long) == struct.pack(">Q", value)
    assert to_u64(long) == value


@pytest.mark.parametrize("value", [-1, 1 << 64])
def test_a_value_that_is_not_a_u64_is_refused(value: int) -> None:
    with pytest.raises(EncodeError, match="epoch"):
        to_long(value, "epoch")


@given(u64s)
def test_worker_key_is_the_id_big_endian(worker_id: int) -> None:
    key = worker_key(worker_id)
    assert key == struct.pack(">Q", worker_id)
    assert key_worker(key) == worker_id


@pytest.mark.parametrize("key", [None, b"", b"\x00" * 7, b"\x00" * 9])
def test_a_key_of_another_length_names_no_worker(key: bytes | None) -> None:
    assert key_worker(key) is None


@given(st.none() | u64s, st.none() | u64s)
def test_resync_request_round_trips_through_avro(worker_id: int | None, above: int | None) -> None:
    codec = AvroCodec()
    req = ResyncRequest(worker_id, "replica-1", "a gap", 1_700_000_000_000, above)
    name, record = codec.decode(codec.encode(RESYNC_REQUEST, req.to_record()))
    assert name == RESYNC_REQUEST
    assert ResyncRequest.from_record(record) == req
