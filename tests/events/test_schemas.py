"""SchemaStore: loading, fingerprints (checked against the spec's algorithm), bad files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvstream.events.codec import EVENT_BATCH, AvroCodec, EventCodec
from kvstream.events.errors import DecodeError, SchemaError
from kvstream.events.schemas import DEFAULT_SCHEMA_DIR, SchemaStore

_EMPTY = 0xC15D213AA4D7A795


def _rabin_table() -> list[int]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_EMPTY & -(fp & 1))
        table.append(fp)
    return table


def crc64_avro(data: bytes) -> bytes:
    """The Avro specification's 64-bit Rabin fingerprint, written from its description,
    as the 8 little-endian bytes of the single-object header."""
    table = _rabin_table()
    fp = _EMPTY
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp.to_bytes(8, "little")


def test_live_store() -> None:
    store = SchemaStore()
    assert store.directory == DEFAULT_SCHEMA_DIR
    assert EVENT_BATCH in store.names()
    current = store.current(EVENT_BATCH)
    assert current.version == max(v.version for v in store.versions(EVENT_BATCH))
    versions = store.all_versions()
    assert len({sv.fingerprint for sv in versions}) == len(versions)  # one version per fingerprint
    for sv in versions:
        assert sv.fingerprint == crc64_avro(sv.canonical.encode("utf-8"))
        assert sv.path == DEFAULT_SCHEMA_DIR / sv.name / f"v{sv.version}.avsc"


def test_canonical_form_drops_docs_and_uses_full_names() -> None:
    canonical = SchemaStore().current(EVENT_BATCH).canonical
    assert canonical.startswith('{"name":"kvstream.events.EventBatch","type":"record"')
    assert '"doc"' not in canonical and " " not in canonical
    assert '"name":"kvstream.events.Tier"' in canonical


def test_fingerprints_of_spec_vectors(tmp_path: Path) -> None:
    """Vectors of Apache Avro's share/test/data/schema-tests.txt (as signed 64-bit ints)."""
    assert crc64_avro(b'"null"') == (7195948357588979594).to_bytes(8, "little", signed=True)
    assert crc64_avro(b'"int"') == (8247732601305521295).to_bytes(8, "little", signed=True)
    write(tmp_path, "foo", "v1.avsc", {"fields": [], "type": "record", "name": "foo"})
    store = SchemaStore(tmp_path)
    assert store.current("foo").fingerprint == (-4824392279771201922).to_bytes(8, "little", signed=True)


def test_unknown_record_name() -> None:
    with pytest.raises(SchemaError, match="unknown record"):
        AvroCodec().fingerprint("kvstream.nope.Nothing")


RECORD: dict[str, Any] = {"type": "record", "name": "Thing", "namespace": "kvstream.test", "fields": [{"name": "a", "type": "long"}]}


def write(root: Path, name: str, file: str, schema: Any) -> None:
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / file).write_text(schema if isinstance(schema, str) else json.dumps(schema))


def test_generic_records_and_versions(tmp_path: Path) -> None:
    write(tmp_path, "kvstream.test.Thing", "v1.avsc", RECORD)
    v2 = {**RECORD, "fields": [*RECORD["fields"], {"name": "b", "type": "string", "default": "x"}]}
    write(tmp_path, "kvstream.test.Thing", "v2.avsc", v2)
    shutil.copytree(DEFAULT_SCHEMA_DIR, tmp_path, dirs_exist_ok=True)
    codec = AvroCodec(SchemaStore(tmp_path))
    assert codec.decode(codec.encode("kvstream.test.Thing", {"a": 1, "b": "y"})) == ("kvstream.test.Thing", {"a": 1, "b": "y"})
    pinned = AvroCodec(SchemaStore(tmp_path, pins={"kvstream.test.Thing": 1}))
    assert codec.decode(pinned.encode("kvstream.test.Thing", {"a": 2})) == ("kvstream.test.Thing", {"a": 2, "b": "x"})
    # A record of another type reaching the event codec is rejected, not misread.
    with pytest.raises(DecodeError, match="expected a kvstream.events.EventBatch") as info:
        EventCodec(codec).decode(codec.encode("kvstream.test.Thing", {"a": 1}))
    assert info.value.reason == "type"


BAD_FILES = {
    "bad file name": ("kvstream.test.Thing", "1.avsc", RECORD, "v<N>.avsc"),
    "not json": ("kvstream.test.Thing", "v1.avsc", "{nope", "cannot read"),
    "not avro": ("kvstream.test.Thing", "v1.avsc", {**RECORD, "fields": [{"name": "a", "type": "nosuch"}]}, "invalid Avro"),
    "not a record": ("kvstream.test.Thing", "v1.avsc", "\"long\"", "must be a record"),
    "name mismatch": ("kvstream.test.Other", "v1.avsc", RECORD, "named 'kvstream.test.Thing'"),
    "enum without default": (
        "kvstream.test.Thing",
        "v1.avsc",
        {**RECORD, "fields": [{"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A"]}}]},
        "no default",
    ),
    "zero-byte array items": (
        "kvstream.test.Thing",
        "v1.avsc",
        {**RECORD, "fields": [{"name": "xs", "type": {"type": "array", "items": "null"}}]},
        "0 bytes",
    ),
    "zero-byte record items": (
        "kvstream.test.Thing",
        "v1.avsc",
        {**RECORD, "fields": [{"name": "xs", "type": {"type": "array", "items": {"type": "record", "name": "Z", "fields": []}}}]},
        "0 bytes",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_schema_files(tmp_path: Path, case: str) -> None:
    name, file, schema, text = BAD_FILES[case]
    write(tmp_path, name, file, schema)
    with pytest.raises(SchemaError, match=text):
        SchemaStore(tmp_path)


def test_duplicate_version(tmp_path: Path) -> None:
    write(tmp_path, "kvstream.test.Thing", "v1.avsc", RECORD)
    write(tmp_path, "kvstream.test.Thing", "v2.avsc", {**RECORD, "doc": "same canonical form"})
    with pytest.raises(SchemaError, match="same fingerprint"):
        SchemaStore(tmp_path)


def test_missing_or_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="does not exist"):
        SchemaStore(tmp_path / "nope")
    with pytest.raises(SchemaError, match="no schemas"):
        SchemaStore(tmp_path)


def test_bad_pin() -> None:
    with pytest.raises(SchemaError, match="cannot pin"):
        SchemaStore(pins={EVENT_BATCH: 99})
