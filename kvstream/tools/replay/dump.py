"""``replay dump``: the events of a range, one row per event, filtered.

Besides the router events (``stored``, ``removed``, ``cleared``) a record can be a
``heartbeat`` (a batch with no events), a ``tick`` (a replica's log-clock tick) or
``undecodable`` (what a replica sends to the DLQ); those are rows too, so that a dump
shows everything that moved the fold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvstream.events.codec import EventCodec
from kvstream.events.errors import DecodeError
from kvstream.events.model import Cleared, EventBatch, Removed, Stored, Tier
from kvstream.replica.record import Record
from kvstream.tools.replay.reader import format_time

KINDS = ("stored", "removed", "cleared", "heartbeat", "tick", "undecodable")
#: Fields holding 64-bit values (u64 ids and hashes; lease_ms up to 2^63): many JSON
#: tools read numbers as doubles, exact only up to 2^53, so JSON lines carry them as
#: decimal strings unless asked for numbers.
WIDE_FIELDS = ("worker_id", "epoch", "lease_ms", "event_id", "parent_hash")
WIDE_LIST_FIELDS = ("block_hashes", "tokens_hashes")
KIND_OF = {Stored: "stored", Removed: "removed", Cleared: "cleared"}


@dataclass(frozen=True, slots=True)
class EventFilter:
    """Which rows to keep; None means any. A row must match every given filter; a row
    with no worker (tick, undecodable) fails any worker, rank, tier or hash filter."""

    workers: frozenset[int] | None = None
    ranks: frozenset[int] | None = None
    tiers: frozenset[Tier] | None = None
    kinds: frozenset[str] | None = None
    #: Matches a block hash, a tokens hash or the parent hash of an event.
    block_hash: int | None = None

    def matches(self, row: dict[str, Any]) -> bool:
        if self.kinds is not None and row["kind"] not in self.kinds:
            return False
        if self.workers is not None and row["worker_id"] not in self.workers:
            return False
        if self.ranks is not None and row["dp_rank"] not in self.ranks:
            return False
        if self.tiers is not None and (row["tier"] is None or Tier(row["tier"]) not in self.tiers):
            return False
        if self.block_hash is not None:
            h = self.block_hash
            return h == row["parent_hash"] or h in row["block_hashes"] or h in row["tokens_hashes"]
        return True


def _row(r: Record, kind: str, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "partition": r.partition,
        "offset": r.offset,
        "timestamp_ms": r.timestamp_ms,
        "time": format_time(r.timestamp_ms),
        "kind": kind,
        "worker_id": None,
        "epoch": None,
        "lease_ms": None,
        "dp_rank": None,
        "tier": None,
        "event_id": None,
        "parent_hash": None,
        "block_hashes": [],
        "tokens_hashes": [],
        "error": None,
    }
    row.update(fields)
    return row


def record_rows(r: Record, decode: Callable[[bytes], EventBatch]) -> list[dict[str, Any]]:
    """The rows of one record of the events topic."""
    if r.is_tick:
        return [_row(r, "tick")]
    try:
        if r.value is None:
            raise DecodeError("record has no value")
        batch = decode(r.value)
    except DecodeError as exc:
        return [_row(r, "undecodable", error=str(exc))]
    head = {"worker_id": batch.worker_id, "epoch": batch.epoch, "lease_ms": batch.lease_ms}
    if not batch.events:
        return [_row(r, "heartbeat", **head)]
    rows = []
    for ev in batch.events:
        fields: dict[str, Any] = {
            **head, "dp_rank": ev.dp_rank, "tier": ev.tier.value, "event_id": ev.event_id,
        }
        if isinstance(ev, Stored):
            fields.update(
                parent_hash=ev.parent_hash, block_hashes=list(ev.block_hashes),
                tokens_hashes=list(ev.tokens_hashes),
            )
        elif isinstance(ev, Removed):
            fields["block_hashes"] = list(ev.block_hashes)
        rows.append(_row(r, KIND_OF[type(ev)], **fields))
    return rows


def dump_rows(records: Iterable[Record], filt: EventFilter) -> Iterator[dict[str, Any]]:
    decode = EventCodec().decode
    match = filt.matches
    for r in records:
        for row in record_rows(r, decode):
            if match(row):
                yield row


def json_row(row: dict[str, Any], wide_as_numbers: bool = False) -> dict[str, Any]:
    """``row`` for JSON: 64-bit values as decimal strings (None stays null), or as they
    are with ``wide_as_numbers``."""
    if wide_as_numbers:
        return row
    out = dict(row)
    for name in WIDE_FIELDS:
        if out[name] is not None:
            out[name] = str(out[name])
    for name in WIDE_LIST_FIELDS:
        out[name] = [str(h) for h in out[name]]
    return out


# -- table for people -------------------------------------------------------------------

TABLE_HEADER = (
    f"{'time':<24} {'part/offset':>12} {'worker':>20} {'epoch':>5} {'rank':>4} "
    f"{'tier':<11} {'kind':<11} {'event_id':>8} {'blocks':>6}  first hash / detail"
)


def table_line(row: dict[str, Any]) -> str:
    def opt(v: Any) -> str:
        return "-" if v is None else str(v)

    blocks = row["block_hashes"]
    if row["error"]:
        detail = row["error"]
    elif blocks:
        detail = str(blocks[0]) + (f" … {blocks[-1]}" if len(blocks) > 1 else "")
        if row["parent_hash"] is not None:
            detail += f" (parent {row['parent_hash']})"
    else:
        detail = ""
    return (
        f"{row['time']:<24} {row['partition']:>4}/{row['offset']:<7} {opt(row['worker_id']):>20} "
        f"{opt(row['epoch']):>5} {opt(row['dp_rank']):>4} {opt(row['tier']):<11} "
        f"{row['kind']:<11} {opt(row['event_id']):>8} {len(blocks):>6}  {detail}"
    )
