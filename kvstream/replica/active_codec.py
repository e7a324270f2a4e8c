"""Active-sequence ops (kvstream.router.active) ↔ ``kvstream.active.ActiveOp`` records.

Ops carry scoped request ids (kvstream.replica.request_ids); records carry the client's
id next to the replica id, and decoding scopes it again by that replica id."""

from __future__ import annotations

from kvstream.events.codec import AvroCodec, pack_u64, unpack_u64
from kvstream.events.errors import DecodeError
from kvstream.events.wire import to_long, to_u64
from kvstream.replica.request_ids import is_safe, scoped, unscoped
from kvstream.router.active import ActiveOp, AddRequest, FreeRequest, PackedHashes, PrefillDone
from kvstream.router.router import RouterConfig

ACTIVE_OP = "kvstream.active.ActiveOp"


class ActiveOpCodec:
    def __init__(self, codec: AvroCodec | None = None) -> None:
        self.codec = codec if codec is not None else AvroCodec()

    def encode(self, replica_id: str, op: ActiveOp) -> bytes:
        record: dict[str, object] = {
            "replica_id": replica_id,
            "request_id": unscoped(op.request_id),
            "timestamp_ms": int(op.timestamp * 1000),
            "worker_id": 0,
            "dp_rank": 0,
            "isl": 0,
            "overlap_tokens": 0,
            "sequence_hashes": b"",
            "refuted": False,
        }
        if isinstance(op, AddRequest):
            record.update(
                kind="ADD",
                worker_id=to_long(op.worker_id, "worker_id"),
                dp_rank=op.dp_rank,
                isl=op.isl,
                overlap_tokens=op.overlap_tokens,
                sequence_hashes=seqs.data if isinstance(seqs := op.sequence_hashes, PackedHashes) else pack_u64(seqs),
            )
        elif isinstance(op, PrefillDone):
            record["kind"] = "PREFILL_DONE"
        else:
            record.update(kind="FREE", refuted=op.refuted)
        return self.codec.encode(ACTIVE_OP, record)

    def decode(self, data: bytes) -> tuple[str, ActiveOp]:
        """(replica id, op), or DecodeError."""
        name, r = self.codec.decode(data)
        if name != ACTIVE_OP:
            raise DecodeError(f"expected a {ACTIVE_OP} record, got {name}")
        ts = r["timestamp_ms"] / 1000
        kind = r["kind"]
        if not is_safe(r["request_id"]):
            raise DecodeError(f"active op with an unsafe request id {r['request_id'][:140]!r}")
        r["request_id"] = scoped(r["replica_id"], r["request_id"])
        if kind == "ADD":
            if r["isl"] < 0 or r["overlap_tokens"] < 0 or not 0 <= r["dp_rank"] < 2**32:
                raise DecodeError("active op with a negative length or a bad dp_rank")
            op: ActiveOp = AddRequest(
                r["request_id"], to_u64(r["worker_id"]), r["dp_rank"], r["isl"],
                r["overlap_tokens"], unpack_u64(r["sequence_hashes"]), ts,
            )
        elif kind == "PREFILL_DONE":
            op = PrefillDone(r["request_id"], ts)
        elif kind == "FREE":
            op = FreeRequest(r["request_id"], ts, r.get("refuted", False))  # a v1 record has none
        else:
            raise DecodeError(f"active op of unknown kind {kind}")
        return r["replica_id"], op


def load_window_start_ms(at_ms: int, config: RouterConfig) -> int:
    """Where the load at ``at_ms`` begins on kvstream.active: a request routed longer than
    its TTL ago has expired, and so has a prediction older than its own, so a restarted
    replica and ``kvstream replay`` both take the ops of the longer of the two ([router]
    request_ttl_s, expected_ttl_s), and no more."""
    return at_ms - int(max(config.request_ttl_s, config.expected_ttl_s) * 1000)
