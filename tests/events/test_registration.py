"""The worker registration record (kvstream.events.registration) without a broker: the
schema against Apache's reference decoder, every rule of a registration enforced, and
v1 and v2 of the record read by each other's readers."""

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
from kvstream.events.schemas import SchemaStore
from kvstream.roles import Handoff, Role
from tests.events.strategies import registrations

CODEC = RegistrationCodec()
#: A reader and writer of the previous release: WorkerRegistration v1.
V1 = RegistrationCodec(AvroCodec(SchemaStore(pins={WORKER_REGISTRATION: 1})))
BASE = dict(worker_id=1, url="http://h:1", models=("m",), loras=(), block_size=16, dp_ranks=(0,),
            engine="vllm", kv_capacity_blocks=None, epoch=1, registered_at_ms=1)
PREFILL = Registration(**BASE, role=Role.PREFILL, handoff=Handoff.BOOTSTRAP, bootstrap_port=8998)


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
    assert ref["role"] == reg.role.name and ref["bootstrap_port"] == reg.bootstrap_port
    assert ref["handoff"] == (None if reg.handoff is None else reg.handoff.name)


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
        ({"role": Role.PREFILL}, "role prefill needs a handoff"),
        ({"role": Role.DECODE}, "role decode needs a handoff"),
        ({"handoff": Handoff.NIXL}, "role both takes no handoff"),
        ({"role": Role.PREFILL, "handoff": Handoff.BOOTSTRAP}, "needs its bootstrap_port"),
        ({"role": Role.DECODE, "handoff": Handoff.NIXL, "bootstrap_port": 8998}, "only with handoff bootstrap"),
        ({"bootstrap_port": 8998}, "only with handoff bootstrap"),
        ({"role": Role.PREFILL, "handoff": Handoff.BOOTSTRAP, "bootstrap_port": 0}, r"not in 1\.\.65535"),
        ({"role": Role.DECODE, "handoff": Handoff.BOOTSTRAP, "bootstrap_port": 65536}, r"not in 1\.\.65535"),
    ],
)
def test_bad_registrations_are_refused(fields: dict, match: str) -> None:
    with pytest.raises(RegistrationError, match=match):
        Registration(**{**BASE, **fields})


def test_the_view_shows_the_role() -> None:
    assert {k: PREFILL.view()[k] for k in ("role", "handoff", "bootstrap_port")} == {
        "role": "prefill", "handoff": "bootstrap", "bootstrap_port": 8998}
    assert {k: Registration(**BASE).view()[k] for k in ("role", "handoff", "bootstrap_port")} == {
        "role": "both", "handoff": None, "bootstrap_port": None}


def test_a_v1_record_is_a_worker_of_role_both_and_a_v1_reader_reads_v2() -> None:
    """A worker of the previous release (WorkerRegistration v1) serves whole requests; a
    reader still on v1 reads a v2 record as the previous release would."""
    both = Registration(**BASE)
    assert CODEC.codec.store.current(WORKER_REGISTRATION).version == 2
    assert CODEC.decode(V1.encode(both)) == both
    assert V1.decode(CODEC.encode(PREFILL)) == both


def test_the_reference_resolves_v1_records_into_v2() -> None:
    """Apache Avro's reference reader, v1 writer schema into the v2 reader schema: the
    defaults the codec relies on."""
    store = SchemaStore()
    v1, v2 = (avro.schema.parse(sv.path.read_text()) for sv in store.versions(WORKER_REGISTRATION))
    data = V1.encode(Registration(**BASE))
    record = avro.io.DatumReader(v1, v2).read(avro.io.BinaryDecoder(io.BytesIO(data[HEADER_LEN:])))
    assert (record["role"], record["handoff"], record["bootstrap_port"]) == ("BOTH", None, None)


@pytest.mark.parametrize(("role", "handoff"), [("UNKNOWN", None), ("PREFILL", "UNKNOWN")])
def test_a_symbol_this_reader_does_not_know_is_an_invalid_registration(role: str, handoff: str | None) -> None:
    """UNKNOWN is what a symbol added by a later version reads as: no role to route by."""
    record = {"worker_id": 1, "url": None, "models": [], "loras": [], "block_size": 16, "dp_ranks": [0],
              "engine": "vllm", "kv_capacity_blocks": None, "epoch": 1, "registered_at_ms": 0,
              "role": role, "handoff": handoff, "bootstrap_port": None}
    with pytest.raises(RegistrationError, match="not one this reader knows") as err:
        CODEC.decode(CODEC.codec.encode(WORKER_REGISTRATION, record))
    assert err.value.reason == "invalid"
