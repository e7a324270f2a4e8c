"""The worker registration record (kvstream.events.registration) without a broker: the
schema against Apache's reference decoder, and every rule of a registration enforced."""

from __future__ import annotations

import io

import avro.io
import avro.schema
import pytest
from hypothesis import given, settings

from kvstream.events.codec import HEADER_LEN, AvroCodec
from kvstream.events.errors import RegistrationError
from kvstream.events.model import U64_MAX
from kvstream.events.registration import WORKER_REGISTRATION, Registration, RegistrationCodec
from tests.events.strategies import registrations

CODEC = RegistrationCodec()


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
    assert ref["worker_id"] & U64_MAX == reg.worker_id and ref["epoch"] & U64_MAX == reg.epoch
    assert (ref["url"], tuple(ref["models"]), tuple(ref["loras"])) == (reg.url, reg.models, reg.loras)
    assert (ref["block_size"], tuple(ref["dp_ranks"]), ref["engine"]) == (reg.block_size, reg.dp_ranks, reg.engine)
    assert (ref["kv_capacity_blocks"], ref["registered_at_ms"]) == (reg.kv_capacity_blocks, reg.registered_at_ms)


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
