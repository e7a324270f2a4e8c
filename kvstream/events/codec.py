"""Avro single-object encoding of kvstream's records (DESIGN.md §2).

A message is ``C3 01`` ‖ the 8-byte little-endian CRC-64-AVRO fingerprint of the writer
schema's Parsing Canonical Form ‖ the Avro binary body. A reader finds the writer schema
by fingerprint among every version in the ``SchemaStore`` and resolves it into its own
current version of that record.

``AvroCodec`` does this for any record as plain dicts; ``EventCodec`` maps
``EventBatch`` ↔ the ``kvstream.events.EventBatch`` record, hashes packed as
little-endian u64 ``bytes``, and u64 values carried by Avro ``long`` as the same 64 bits.

Decoding is a trust boundary: whatever the bytes, it returns a whole value or raises
``DecodeError`` (with a reason code), never another exception and never part of a batch.
Every body is first checked by the compiled strict walk of kvstream.events.strict, which
refuses what Apache Avro's reference decoders refuse (enum and union indexes out of
range, negative included; varints over 64 bits; bad lengths) and finds where the record
ends; then fastavro's compiled reader decodes it, with schema resolution. Both stay
bounded on hostile input: lengths are checked against what is left before anything is
read, and every array item takes at least one byte (checked when schemas load), so a
huge item count runs out of input. Checking first and decoding with fastavro measured
faster than any strict decoder in Python (kvstream bench codec; docs/BENCHMARKS.md).

``EventBatch`` messages of the v1 layout (what the publisher writes) are first read by
the compiled ``kvstream._native.EventBatchReader``, which takes only what the generic
path above decodes into a valid batch and answers None for anything else (which then
goes the generic way, for the result or the exact error); tests/events check both agree
on random valid and invalid bytes. It decodes a small batch ~3x faster (building the
model objects is most of what is left).

The fold takes every record in one form, :data:`PackedRecord` (``EventCodec.read_packed``):
hashes left packed in v1 bytes, and each event's digest. A v1 message is read as it is;
any other that decodes (another schema version, a sized array block) is decoded the
generic way, written again in v1 by the compiled writer and read back, so the fold has
one path whatever the writer wrote (kvstream bench ingest, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from io import BytesIO
from typing import Any

from fastavro import schemaless_reader, schemaless_writer

from kvstream._native import EventBatchReader, encode_event_batch

from kvstream.events.errors import DecodeError, EncodeError, EventError
from kvstream.events.model import Cleared, EventBatch, Removed, RouterEvent, Stored, Tier
from kvstream.events.schemas import SchemaStore, SchemaVersion
from kvstream.events.strict import StrictLayout
from kvstream.events.wire import to_long, to_u64

MARKER = b"\xc3\x01"
HEADER_LEN = len(MARKER) + 8
EVENT_BATCH = "kvstream.events.EventBatch"

_I64_MAX = (1 << 63) - 1
_U32_MAX = (1 << 32) - 1
_MAX_ERROR_DETAIL = 200


def _detail(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {str(exc) or 'no detail'}"
    return text if len(text) <= _MAX_ERROR_DETAIL else text[:_MAX_ERROR_DETAIL] + "…"


class AvroCodec:
    """Single-object encoding of any record known to ``store`` (plain dicts)."""

    def __init__(self, store: SchemaStore | None = None) -> None:
        self.store = store if store is not None else SchemaStore()
        # fingerprint → (record name, strict check of the writer's layout, writer schema,
        # reader schema or None when the writer is the current version: fastavro then
        # skips resolution, the fast path).
        self._readers: dict[bytes, tuple[str, StrictLayout, Any, Any]] = {}
        for sv in self.store.all_versions():
            current = self.store.current(sv.name)
            reader = None if current is sv else current.parsed
            self._readers[sv.fingerprint] = (sv.name, StrictLayout(sv.name, sv.parsed), sv.parsed, reader)

    def fingerprint(self, name: str) -> bytes:
        """Wire fingerprint (8 bytes) of the current version of ``name``."""
        return self.store.current(name).fingerprint

    def schema(self, name: str) -> SchemaVersion:
        return self.store.current(name)

    def encode(self, name: str, record: Mapping[str, Any]) -> bytes:
        """``record`` as a single-object message, written with the current version."""
        sv = self.store.current(name)
        out = BytesIO()
        out.write(MARKER)
        out.write(sv.fingerprint)
        try:
            schemaless_writer(out, sv.parsed, record)
        except Exception as exc:  # fastavro signals bad values with assorted types
            raise EncodeError(f"cannot encode {name} v{sv.version}: {_detail(exc)}") from None
        return out.getvalue()

    def decode(self, data: bytes) -> tuple[str, dict[str, Any]]:
        """(record name, record in the current version of that record) of a message."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DecodeError(f"expected bytes, got {type(data).__name__}", reason="type")
        if len(data) < HEADER_LEN:
            raise DecodeError(
                f"message of {len(data)} bytes is shorter than the {HEADER_LEN}-byte header",
                reason="truncated",
            )
        if data[:2] != MARKER:
            raise DecodeError(
                f"bad marker {bytes(data[:2]).hex()} (expected c301): not a single-object Avro message",
                reason="marker",
            )
        fp = bytes(data[2:HEADER_LEN])
        entry = self._readers.get(fp)
        if entry is None:
            raise DecodeError(f"unknown writer schema fingerprint {fp.hex()}", reason="fingerprint")
        name, layout, writer, reader = entry
        if type(data) is not bytes:
            data = bytes(data)
        end = layout.end_of(data, HEADER_LEN)
        if end != len(data):
            raise DecodeError(f"{len(data) - end} bytes after the end of the {name} record")
        body = BytesIO(data)
        body.seek(HEADER_LEN)
        try:
            record = schemaless_reader(body, writer, reader)
        except Exception as exc:  # past the strict check: a schema resolution failure
            raise DecodeError(f"malformed {name} body: {_detail(exc)}") from None
        return name, record


# --- EventBatch ↔ kvstream.events.EventBatch --------------------------------------------

_TIER_BY_SYMBOL: dict[str, Tier] = {tier.name: tier for tier in Tier}
_SYMBOL_BY_TIER: dict[Tier, str] = {tier: tier.name for tier in Tier}  # Enum.name is slow
#: schemas/kvstream.events.EventBatch/v1.avsc, the layout kvstream._native.encode_event_batch writes.
_V1_FINGERPRINT = bytes.fromhex("6dfb51447f47a578")
_KIND_SYMBOLS: dict[type, str] = {Stored: "STORED", Removed: "REMOVED", Cleared: "CLEARED"}
#: Model kinds in the order of the compiled reader's kind codes (PackedEvent[0]).
PACKED_KINDS: tuple[type[RouterEvent], ...] = (Stored, Removed, Cleared)
#: Model tiers in the order of its tier codes (PackedEvent[2]).
PACKED_TIERS: tuple[Tier, ...] = tuple(Tier)
#: What stands in an event's digest for a missing parent (and its tier's index in
#: PACKED_TIERS for its tier): ``hash`` of None or of an enum differs between processes.
_NO_PARENT = -1
#: v1's header, and its enum symbols in the model's order: the layout of the fold's
#: packed form (the compiled writer's and reader's); v1's own order, UNKNOWN aside.
_V1_HEADER = MARKER + _V1_FINGERPRINT
_MODEL_TIER_SYMBOLS = tuple(tier.name for tier in PACKED_TIERS)
_MODEL_KIND_SYMBOLS = tuple(_KIND_SYMBOLS[cls] for cls in PACKED_KINDS)


#: An event as the compiled reader gives it: (kind code, dp_rank, tier code, event_id,
#: parent_hash, byte offset of its block hashes in the message, of its tokens hashes,
#: block count, digest). The digest is the same in every process and every version
#: (snapshots keep it): ``hash`` of the tuple of the model event's fields, its tier
#: given by its index in PACKED_TIERS and a missing parent by _NO_PARENT;
#: tests/events/test_packed_reader.py holds the reference in Python.
PackedEvent = tuple[int, int, int, int, int | None, int, int, int, int]
#: (worker_id, epoch, lease_ms, events) of a message, hashes left packed in it.
PackedBatch = tuple[int, int, int, tuple[PackedEvent, ...]]
#: A record as the fold applies it: the v1 bytes its events' offsets point into (the
#: record itself when it is a v1 message) and its PackedBatch.
PackedRecord = tuple[bytes, PackedBatch]
_STRUCTS: dict[int, struct.Struct] = {}
_MAX_CACHED_STRUCTS = 1024


def _packer(count: int) -> struct.Struct:
    # One Struct per hash count: unpacking straight into a tuple is the fastest of
    # numpy.frombuffer().tolist(), array('Q') and memoryview.cast (kvstream bench codec).
    packer = _STRUCTS.get(count)
    if packer is None:
        packer = struct.Struct(f"<{count}Q")
        if len(_STRUCTS) < _MAX_CACHED_STRUCTS:
            _STRUCTS[count] = packer
    return packer


def pack_u64(values: tuple[int, ...] | list[int]) -> bytes:
    """Little-endian u64 packing of hashes; EncodeError if one is outside [0, 2**64)."""
    try:
        return _packer(len(values)).pack(*values)
    except struct.error as exc:
        raise EncodeError(f"hashes must be ints in [0, 2**64): {exc}") from None


def unpack_u64(data: bytes) -> tuple[int, ...]:
    """Inverse of ``pack_u64``; DecodeError when the length is not a multiple of 8."""
    count, rest = divmod(len(data), 8)
    if rest:
        raise DecodeError(f"packed hashes of {len(data)} bytes: not a multiple of 8", reason="invalid")
    return _packer(count).unpack(data)


def _reader(header: bytes, tiers: list[str] | tuple[str, ...], kinds: list[str] | tuple[str, ...]) -> EventBatchReader:
    """The compiled reader of messages with ``header`` whose Tier and Kind enums have
    these symbols: each symbol's position in the model's order (-1: UNKNOWN, which the
    generic path refuses), and the digests' stand-ins."""
    kind_names = [_KIND_SYMBOLS[cls] for cls in PACKED_KINDS]
    return EventBatchReader(
        header,
        [PACKED_TIERS.index(_TIER_BY_SYMBOL[s]) if s in _TIER_BY_SYMBOL else -1 for s in tiers],
        [kind_names.index(s) if s in kind_names else -1 for s in kinds],
        [hash(i) for i in range(len(PACKED_TIERS))],
        hash(_NO_PARENT),
    )


class EventCodec:
    """``EventBatch`` ↔ single-object Avro bytes of ``kvstream.events.EventBatch``."""

    def __init__(self, codec: AvroCodec | None = None) -> None:
        self.codec = codec if codec is not None else AvroCodec()
        current = self.codec.schema(EVENT_BATCH)
        # The compiled writer knows v1's layout; with another current schema (pinned,
        # newer, a test's) every batch takes the generic path.
        self._fast = current.fingerprint == _V1_FINGERPRINT
        self._header = MARKER + current.fingerprint
        event = current.parsed["fields"][3]["type"]["items"]["fields"]
        tiers, kinds = event[1]["type"]["symbols"], event[3]["type"]["symbols"]
        self._tier_index = {tier: tiers.index(tier.name) for tier in Tier}
        self._kind_index = {cls: kinds.index(name) for cls, name in _KIND_SYMBOLS.items()}
        # The compiled reader of the same layout (None: every message goes the generic way).
        self._reader = _reader(self._header, tiers, kinds) if self._fast else None
        # The packed form of read_packed: v1 (the current layout, or v1 in the model's
        # order, which is v1's, when the current schema is another).
        if self._reader is not None:
            self._v1_header, self._v1_tiers, self._v1_kinds = self._header, self._tier_index, self._kind_index
            self._v1_reader = self._reader
        else:
            self._v1_header = _V1_HEADER
            self._v1_tiers = {tier: i for i, tier in enumerate(PACKED_TIERS)}
            self._v1_kinds = {cls: i for i, cls in enumerate(PACKED_KINDS)}
            self._v1_reader = _reader(_V1_HEADER, _MODEL_TIER_SYMBOLS, _MODEL_KIND_SYMBOLS)

    def read_packed(self, data: bytes) -> PackedRecord:
        """The :data:`PackedRecord` of a message, or the DecodeError :meth:`decode` raises
        (the same, by the same path). A v1 message costs one compiled read; any other is
        decoded the generic way and brought to v1 by the compiled writer."""
        reader = self._reader
        if reader is not None and type(data) is bytes:
            packed = reader.read(data)
            if packed is not None:
                return data, packed
        batch = self._decode_generic(data)
        v1 = self._encode_v1(batch, self._v1_header, self._v1_tiers, self._v1_kinds)
        packed = self._v1_reader.read(v1)
        if packed is None:  # the writer and the reader disagree on v1: a bug, not the record's
            raise RuntimeError(f"the compiled reader refused the v1 bytes of a decoded batch: {v1.hex()}")
        return v1, packed

    def encode(self, batch: EventBatch) -> bytes:
        if self._fast:
            # The compiled writer of the same bytes (tests compare both); anything it
            # refuses (a value out of range, not a model object) goes the generic way,
            # which says precisely what is wrong.
            try:
                return self._encode_fast(batch)
            except (OverflowError, TypeError, KeyError, AttributeError):
                pass
        return self._encode_generic(batch)

    def _encode_fast(self, batch: EventBatch) -> bytes:
        """The compiled writer's bytes of ``batch`` in the current layout (v1's)."""
        return self._encode_v1(batch, self._header, self._tier_index, self._kind_index)

    @staticmethod
    def _encode_v1(batch: EventBatch, header: bytes, tier_index: dict[Tier, int], kind_index: dict[type, int]) -> bytes:
        """The compiled writer's v1 bytes of ``batch``, with these enum indexes."""
        events = tuple(
            (
                kind_index[type(ev)], ev.dp_rank, tier_index[ev.tier], ev.event_id,
                ev.parent_hash if type(ev) is Stored else None,
                ev.block_hashes if type(ev) is not Cleared else (),
                ev.tokens_hashes if type(ev) is Stored else (),
            )
            for ev in batch.events
        )
        return encode_event_batch(header, batch.worker_id, batch.epoch, batch.lease_ms, events)

    def _encode_generic(self, batch: EventBatch) -> bytes:
        try:
            record = self._batch_record(batch)
        except (TypeError, KeyError, AttributeError) as exc:  # not ints, not a Tier...
            raise EncodeError(f"cannot encode batch: {_detail(exc)}") from None
        return self.codec.encode(EVENT_BATCH, record)

    def _batch_record(self, batch: EventBatch) -> dict[str, Any]:
        if not 0 <= batch.lease_ms <= _I64_MAX:
            raise EncodeError(f"lease_ms {batch.lease_ms!r} must be in [0, 2**63)")
        return {
            "worker_id": to_long(batch.worker_id, "worker_id"),
            "epoch": to_long(batch.epoch, "epoch"),
            "lease_ms": batch.lease_ms,
            "events": [self._event_record(ev) for ev in batch.events],
        }

    @staticmethod
    def _event_record(ev: RouterEvent) -> dict[str, Any]:
        if not 0 <= ev.dp_rank <= _U32_MAX:
            raise EncodeError(f"dp_rank {ev.dp_rank!r} is not a u32")
        record: dict[str, Any] = {
            "dp_rank": ev.dp_rank,
            "tier": _SYMBOL_BY_TIER[ev.tier],
            "event_id": to_long(ev.event_id, "event_id"),
            "parent_hash": None,
            "block_hashes": b"",
            "tokens_hashes": b"",
        }
        if isinstance(ev, Stored):
            record["kind"] = "STORED"
            if ev.parent_hash is not None:
                record["parent_hash"] = to_long(ev.parent_hash, "parent_hash")
            record["block_hashes"] = pack_u64(ev.block_hashes)
            record["tokens_hashes"] = pack_u64(ev.tokens_hashes)
        elif isinstance(ev, Removed):
            record["kind"] = "REMOVED"
            record["block_hashes"] = pack_u64(ev.block_hashes)
        elif isinstance(ev, Cleared):
            record["kind"] = "CLEARED"
        else:
            raise EncodeError(f"not a router event: {type(ev).__name__}")
        return record

    def decode(self, data: bytes) -> EventBatch:
        if self._reader is not None and type(data) is bytes:
            packed = self._reader.read(data)
            if packed is not None:
                return self._from_packed(data, packed)
        return self._decode_generic(data)

    @staticmethod
    def _from_packed(data: bytes, packed: PackedBatch) -> EventBatch:
        worker_id, epoch, lease_ms, events = packed
        out: list[RouterEvent] = []
        for kind, dp_rank, tier_code, event_id, parent, blocks_at, tokens_at, n, _ in events:
            cls, tier = PACKED_KINDS[kind], PACKED_TIERS[tier_code]
            if cls is Stored:
                unpack = _packer(n).unpack_from
                out.append(Stored(
                    worker_id, dp_rank, tier, epoch, event_id, parent, unpack(data, blocks_at), unpack(data, tokens_at)
                ))
            elif cls is Removed:
                out.append(Removed(worker_id, dp_rank, tier, epoch, event_id, _packer(n).unpack_from(data, blocks_at)))
            else:
                out.append(Cleared(worker_id, dp_rank, tier, epoch, event_id))
        return EventBatch(worker_id, epoch, lease_ms, tuple(out))

    def _decode_generic(self, data: bytes) -> EventBatch:
        """Strict walk, fastavro, the model's checks: the reference of the compiled reader."""
        name, record = self.codec.decode(data)
        if name != EVENT_BATCH:
            raise DecodeError(f"expected a {EVENT_BATCH} record, got {name}", reason="type")
        try:
            return self._batch(record)
        except DecodeError:
            raise
        except (EventError, KeyError, TypeError) as exc:  # the model's own checks
            raise DecodeError(f"invalid event batch: {_detail(exc)}", reason="invalid") from None

    @staticmethod
    def _batch(record: dict[str, Any]) -> EventBatch:
        worker_id = to_u64(record["worker_id"])
        epoch = to_u64(record["epoch"])
        lease_ms = record["lease_ms"]
        if lease_ms < 0:
            raise DecodeError(f"negative lease_ms {lease_ms}", reason="invalid")
        events: list[RouterEvent] = []
        append = events.append
        tiers = _TIER_BY_SYMBOL
        for i, ev in enumerate(record["events"]):
            dp_rank = ev["dp_rank"]
            if not 0 <= dp_rank <= _U32_MAX:
                raise DecodeError(f"event {i}: dp_rank {dp_rank} is not a u32", reason="invalid")
            tier = tiers.get(ev["tier"])
            if tier is None:
                raise DecodeError(
                    f"event {i}: tier {ev['tier']} (from a newer schema?) cannot be applied",
                    reason="invalid",
                )
            kind = ev["kind"]
            event_id = to_u64(ev["event_id"])
            parent = ev["parent_hash"]
            if kind == "STORED":
                append(
                    Stored(
                        worker_id,
                        dp_rank,
                        tier,
                        epoch,
                        event_id,
                        None if parent is None else to_u64(parent),
                        unpack_u64(ev["block_hashes"]),
                        unpack_u64(ev["tokens_hashes"]),
                    )
                )
                continue
            if kind != "REMOVED" and kind != "CLEARED":
                raise DecodeError(f"event {i}: kind {kind} (from a newer schema?) cannot be applied", reason="invalid")
            if parent is not None or ev["tokens_hashes"]:
                raise DecodeError(f"event {i}: {kind} event carries stored-only fields", reason="invalid")
            if kind == "REMOVED":
                append(Removed(worker_id, dp_rank, tier, epoch, event_id, unpack_u64(ev["block_hashes"])))
            elif ev["block_hashes"]:
                raise DecodeError(f"event {i}: CLEARED event carries block hashes", reason="invalid")
            else:
                append(Cleared(worker_id, dp_rank, tier, epoch, event_id))
        return EventBatch(worker_id, epoch, lease_ms, tuple(events))
