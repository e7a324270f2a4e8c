"""Avro schemas of every record kvstream puts on Kafka, every version kept (DESIGN.md §2).

Layout (see ``schemas/README.md``): ``<dir>/<full record name>/v<N>.avsc``, each file one
self-contained schema. The highest version of a name is its *current* version (what this
process writes, and the reader schema it decodes into) unless pinned lower, e.g. while a
new version is rolled out to readers before writers. Every version is addressable by the
CRC-64-AVRO fingerprint of its Parsing Canonical Form, which is what the single-object
encoding carries.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastavro import parse_schema
from fastavro.schema import fingerprint as avro_fingerprint
from fastavro.schema import to_parsing_canonical_form

from kvstream.events.errors import SchemaError

#: ``<repo root>/schemas``: next to the package in a source tree and in the wheel.
DEFAULT_SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schemas"

_VERSION_FILE = re.compile(r"v([1-9][0-9]*)\.avsc")
_PRIMITIVE_MIN_BYTES = {
    "null": 0,
    "boolean": 1,
    "int": 1,
    "long": 1,
    "float": 4,
    "double": 8,
    "bytes": 1,
    "string": 1,
}


@dataclass(frozen=True, slots=True)
class SchemaVersion:
    """One version of one record schema."""

    name: str
    version: int
    #: fastavro's parsed form, ready for schemaless_reader/writer.
    parsed: Any
    canonical: str
    #: The 8 bytes of the CRC-64-AVRO fingerprint as they appear on the wire (little-endian).
    fingerprint: bytes
    path: Path


def _min_encoded_size(schema: Any, named: dict[str, Any]) -> int:
    """Fewest bytes a value of ``schema`` can encode to."""
    if isinstance(schema, str):
        if schema in _PRIMITIVE_MIN_BYTES:
            return _PRIMITIVE_MIN_BYTES[schema]
        return _min_encoded_size(named[schema], named)
    if isinstance(schema, list):
        return 1  # the branch index
    kind = schema["type"]
    if kind == "record" or kind == "error":
        return sum(_min_encoded_size(f["type"], named) for f in schema["fields"])
    if kind == "fixed":
        return int(schema["size"])
    if kind in ("enum", "array", "map"):
        return 1  # index, or the closing zero count
    return _min_encoded_size(kind, named)


def _check_schema(schema: Any, named: dict[str, Any], path: Path, seen: set[str]) -> None:
    """Rules that keep decoding safe and evolvable, checked on every file at load.

    - An array's items must take at least one byte: the decoder then runs out of input
      after at most len(input) items, whatever count a corrupt message claims (an array
      of nulls with a count of 2^60 would otherwise spin for ever).
    - Every enum has a default, so that a reader survives a symbol added later.
    """
    if isinstance(schema, str):
        return
    if isinstance(schema, list):
        for branch in schema:
            _check_schema(branch, named, path, seen)
        return
    kind = schema["type"]
    if isinstance(kind, (dict, list)):
        _check_schema(kind, named, path, seen)
        return
    name = schema.get("name")
    if name is not None:
        if name in seen:
            return
        seen.add(name)
    if kind in ("record", "error"):
        for field in schema["fields"]:
            _check_schema(field["type"], named, path, seen)
    elif kind == "array":
        if _min_encoded_size(schema["items"], named) < 1:
            raise SchemaError(f"{path}: array items of {schema['items']!r} can encode to 0 bytes")
        _check_schema(schema["items"], named, path, seen)
    elif kind == "map":
        _check_schema(schema["values"], named, path, seen)
    elif kind == "enum" and "default" not in schema:
        raise SchemaError(f"{path}: enum {name} has no default symbol")


def _load_file(name: str, path: Path, version: int) -> SchemaVersion:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SchemaError(f"{path}: cannot read schema: {exc}") from None
    named: dict[str, Any] = {}
    try:
        parsed = parse_schema(raw, named_schemas=named)
        canonical = to_parsing_canonical_form(raw)
    except Exception as exc:  # fastavro reports bad schemas with several exception types
        raise SchemaError(f"{path}: invalid Avro schema: {exc}") from None
    if not isinstance(parsed, dict) or parsed.get("type") != "record":
        raise SchemaError(f"{path}: top-level schema must be a record")
    if parsed["name"] != name:
        raise SchemaError(f"{path}: schema is named {parsed['name']!r}, its directory {name!r}")
    _check_schema(parsed, named, path, set())
    fp = bytes.fromhex(avro_fingerprint(canonical, "CRC-64-AVRO"))
    return SchemaVersion(name, version, parsed, canonical, fp, path)


class SchemaStore:
    """Every known version of every record schema, by name and by fingerprint.

    ``directory`` defaults to ``DEFAULT_SCHEMA_DIR``; ``pins`` maps a record name to the
    version to use as current instead of the highest one.
    """

    def __init__(self, directory: Path | str | None = None, *, pins: Mapping[str, int] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else DEFAULT_SCHEMA_DIR
        if not self.directory.is_dir():
            raise SchemaError(f"schema directory {self.directory} does not exist")
        self._versions: dict[str, dict[int, SchemaVersion]] = {}
        self._by_fingerprint: dict[bytes, SchemaVersion] = {}
        for record_dir in sorted(p for p in self.directory.iterdir() if p.is_dir()):
            for path in sorted(record_dir.glob("*.avsc")):
                match = _VERSION_FILE.fullmatch(path.name)
                if match is None:
                    raise SchemaError(f"{path}: schema files must be named v<N>.avsc")
                sv = _load_file(record_dir.name, path, int(match.group(1)))
                other = self._by_fingerprint.get(sv.fingerprint)
                if other is not None:
                    raise SchemaError(f"{path} has the same fingerprint as {other.path}")
                self._by_fingerprint[sv.fingerprint] = sv
                self._versions.setdefault(sv.name, {})[sv.version] = sv
        if not self._versions:
            raise SchemaError(f"no schemas under {self.directory}")
        self._current = {name: versions[max(versions)] for name, versions in self._versions.items()}
        for name, version in (pins or {}).items():
            try:
                self._current[name] = self._versions[name][version]
            except KeyError:
                raise SchemaError(f"cannot pin {name} to v{version}: no such schema") from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._versions))

    def versions(self, name: str) -> tuple[SchemaVersion, ...]:
        """Every version of ``name``, oldest first."""
        try:
            versions = self._versions[name]
        except KeyError:
            raise SchemaError(f"unknown record {name!r}; known: {', '.join(self.names())}") from None
        return tuple(versions[v] for v in sorted(versions))

    def current(self, name: str) -> SchemaVersion:
        """The version this process writes ``name`` with and reads it into."""
        try:
            return self._current[name]
        except KeyError:
            raise SchemaError(f"unknown record {name!r}; known: {', '.join(self.names())}") from None

    def all_versions(self) -> tuple[SchemaVersion, ...]:
        return tuple(self._by_fingerprint.values())
