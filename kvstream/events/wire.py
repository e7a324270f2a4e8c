"""How kvstream's ids travel: u64 ids as Avro longs and as record keys.

Worker ids, epochs, event ids and hashes are u64; Avro has only a signed long, so the
same 64 bits are carried as a two's-complement long (:func:`to_long`) and read back by
masking (:func:`to_u64`). A worker's records are keyed by its id as 8 big-endian bytes
(:func:`worker_key`): every record of one worker lands on one partition, in order, and a
Java LongDeserializer reads the key as the same 64 bits.
"""

from __future__ import annotations

from kvstream.events.errors import EncodeError
from kvstream.events.model import U64_MAX

_I64_MAX = (1 << 63) - 1
WORKER_KEY_BYTES = 8


def to_long(value: int, what: str = "value") -> int:
    """u64 → the Avro long with the same 64 bits; EncodeError if ``value`` is not a u64."""
    if not 0 <= value <= U64_MAX:
        raise EncodeError(f"{what} {value!r} is not a u64")
    return value - (1 << 64) if value > _I64_MAX else value


def to_u64(value: int) -> int:
    """An Avro long → the u64 with the same 64 bits (the inverse of :func:`to_long`)."""
    return value & U64_MAX


def worker_key(worker_id: int) -> bytes:
    """The record key of a worker: its id as 8 big-endian bytes."""
    return worker_id.to_bytes(WORKER_KEY_BYTES, "big")


def key_worker(key: bytes | None) -> int | None:
    """The worker id a record key names, or None when it is not a worker's key."""
    if key is None or len(key) != WORKER_KEY_BYTES:
        return None
    return int.from_bytes(key, "big")
