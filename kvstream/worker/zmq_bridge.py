"""ZMQ engine bridge (DESIGN.md §3): a stock vLLM or SGLang KV-event stream in, source
events out (to the consolidator).

Wire format, as checked against vLLM's ``vllm/distributed/kv_events.py``
(``ZmqEventPublisher``): each message is a multipart ``[topic, seq, payload]`` where
``seq`` is an 8-byte big-endian counter per publisher and ``payload`` is msgpack of an
``EventBatch``. vLLM declares its structs with msgspec: ``KVCacheEvent(msgspec.Struct,
tag=True, ...)``, so each event carries its class name as tag. Releases declared with
``array_like=True`` (the common form, and DESIGN §3) encode a batch as
``[ts, events, data_parallel_rank]`` and an event as an array whose first element is
the tag: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name, ...]``, ``["BlockRemoved", block_hashes, medium, ...]``,
``["AllBlocksCleared"]``; releases without ``array_like`` encode maps with the tag under
``"type"`` (msgspec's default tag field; seen in one recent revision of that file).
SGLang's publisher mirrors vLLM's format (per Dynamo's relay, which reads both with one
parser; not checked against SGLang's own source). Both forms are accepted; trailing fields that newer
releases append (``extra_keys``...) are ignored, except ``group_idx``: events of groups
other than 0 are skipped (counted), and fields older ones
lack (``medium``, ``lora_name``) read as missing. The replay endpoint is a ROUTER that
takes ``[b"", start_seq (8-byte big-endian)]`` from a DEALER and answers one
``[b"", seq, payload]`` per buffered message from ``start_seq`` on, then
``[b"", -1 (8 bytes, signed), b""]``.

Bad input is counted by reason (:class:`Issue`), logged, and skipped; it is never fatal.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack
import xxhash
import zmq

from kvstream.events.errors import UnknownMediumError
from kvstream.events.model import Tier, tier_from_medium
from kvstream.hashing import local_hashes
from kvstream.logs import get_logger
from kvstream.worker.errors import EngineBridgeError
from kvstream.worker.source_events import (
    SourceCleared,
    SourceEvent,
    SourceEventSink,
    SourceRemoved,
    SourceStored,
)

log = get_logger(__name__)

_U64 = (1 << 64) - 1
_END_SEQ = _U64  # -1 as signed 8 bytes, read unsigned


class Issue(str, Enum):
    """Why engine input was skipped (or what went missing)."""

    MALFORMED_FRAME = "malformed_frame"  # not [topic, 8-byte seq, payload]
    MALFORMED_PAYLOAD = "malformed_payload"  # not msgpack of a batch
    MALFORMED_EVENT = "malformed_event"  # an event whose fields do not fit the format
    UNKNOWN_TAG = "unknown_tag"  # an event type this bridge does not know
    UNKNOWN_MEDIUM = "unknown_medium"  # medium that maps to no tier (DESIGN §2)
    LORA_WITHOUT_NAME = "lora_without_name"  # lora_id but no lora_name: hashes unknowable
    GAP = "gap"  # engine messages missed (by sequence number), before any replay
    UNRECOVERED = "unrecovered"  # missed messages that the replay did not deliver
    ENGINE_RESTART = "engine_restart"  # sequence number went backwards
    #: Events of a KV-cache group other than group 0: hybrid models (e.g. sliding-window
    #: layers) report each group's blocks; the routers track the main group only.
    OTHER_KV_GROUP = "other_kv_group"


@dataclass(frozen=True, slots=True)
class BridgeOptions:
    #: The engine's PUB endpoint, e.g. ``tcp://127.0.0.1:5557``.
    endpoint: str
    #: The engine's replay (ROUTER) endpoint; None: gaps are counted, not repaired.
    replay_endpoint: str | None = None
    #: Subscription prefix (vLLM's ``topic``, empty by default).
    topic: bytes = b""
    #: Rank used when a batch carries none.
    default_dp_rank: int = 0
    #: How long to wait for a replay to finish.
    replay_timeout_ms: int = 2000
    #: Receive high-water mark, in messages.
    rcvhwm: int = 1_000_000


def _u64(h: Any) -> int:
    """An engine block hash as u64: negative i64 reinterpreted; a bytes digest (newer
    vLLM releases may send those) folded to 64 bits by XXH3, stable per digest."""
    if isinstance(h, int) and not isinstance(h, bool):
        if -(1 << 63) <= h <= _U64:
            return h & _U64
        raise ValueError(f"block hash {h} outside the 64-bit range")
    if isinstance(h, bytes | bytearray):
        return xxhash.xxh3_64_intdigest(bytes(h))
    raise TypeError(f"block hash of type {type(h).__name__}")


def _u64_list(hashes: Any) -> tuple[int, ...]:
    if not isinstance(hashes, list | tuple):
        raise TypeError("block_hashes is not an array")
    try:
        # The common case, all ints: msgpack ints lie in [-2**63, 2**64), so masking
        # is exact. Anything else (bytes digests, junk) raises TypeError here.
        return tuple([h & _U64 for h in hashes])
    except TypeError:
        return tuple(_u64(h) for h in hashes)


class _Skip(Exception):
    """An engine event that is not applied; carries the reason."""

    def __init__(self, issue: Issue, detail: str) -> None:
        super().__init__(detail)
        self.issue = issue


#: Field names of each event kind in wire order (after the tag, in array form).
_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _fields(ev: Any, names: tuple[str, ...]) -> list[Any]:
    """The named fields of an array-like event (after its tag; missing trailing fields
    read as None) or of a map-encoded one, in the order of ``names``."""
    if isinstance(ev, dict):
        return [ev.get(n) for n in names]
    values = list(ev[1 : len(names) + 1])
    if len(values) < len(names):
        values += [None] * (len(names) - len(values))
    return values


def _tier(medium: Any) -> Tier:
    if medium is not None and not isinstance(medium, str):
        raise _Skip(Issue.MALFORMED_EVENT, f"medium of type {type(medium).__name__}")
    try:
        return tier_from_medium(medium)
    except UnknownMediumError as exc:
        raise _Skip(Issue.UNKNOWN_MEDIUM, str(exc)) from None


def convert_event(ev: Any, dp_rank: int, seen_tiers: set[Tier]) -> list[SourceEvent]:
    """One decoded engine event → source events. Raises :class:`_Skip` for input that
    cannot be applied. ``seen_tiers`` (tiers this engine reported on ``dp_rank``) is
    updated, and names what ``AllBlocksCleared`` clears."""
    if isinstance(ev, dict):
        tag = ev.get("type")
    elif isinstance(ev, list | tuple) and ev:
        tag = ev[0]
    else:
        raise _Skip(Issue.MALFORMED_EVENT, f"event is a {type(ev).__name__}, not a tagged array or map")
    try:
        if tag == "BlockStored":
            return [_stored(_fields(ev, _STORED_FIELDS), dp_rank, seen_tiers)]
        if tag == "BlockRemoved":
            raw_hashes, medium, group = _fields(ev, _REMOVED_FIELDS)
            _check_group(tag, group)
            tier = _tier(medium)
            hashes = _u64_list(raw_hashes)
            seen_tiers.add(tier)
            return [SourceRemoved(tier, dp_rank, hashes)] if hashes else []
        if tag == "AllBlocksCleared":
            # The event names no medium: the engine dropped everything it had reported.
            return [SourceCleared(t, dp_rank) for t in sorted(seen_tiers, key=list(Tier).index)]
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise _Skip(Issue.MALFORMED_EVENT, f"{tag}: {exc}") from None
    raise _Skip(Issue.UNKNOWN_TAG, f"unknown event tag {tag!r}")


def _check_group(tag: str, group: Any) -> None:
    if group not in (None, 0):
        raise _Skip(Issue.OTHER_KV_GROUP, f"{tag} of KV-cache group {group!r}")


def _stored(fields: list[Any], dp_rank: int, seen_tiers: set[Tier]) -> SourceStored:
    raw_hashes, parent_raw, token_ids, block_size, lora_id, medium, lora_name, _, group = fields
    _check_group("BlockStored", group)
    hashes = _u64_list(raw_hashes)
    parent = None if parent_raw is None else _u64(parent_raw)
    tier = _tier(medium)
    if not isinstance(token_ids, list | tuple):
        raise ValueError("token_ids is not an array")
    if type(block_size) is not int or block_size <= 0:
        raise ValueError(f"block_size {block_size!r}")
    if not hashes or len(token_ids) != len(hashes) * block_size:
        raise ValueError(f"{len(hashes)} blocks of {block_size} tokens but {len(token_ids)} token ids")
    if lora_name is not None and not isinstance(lora_name, str):
        raise ValueError(f"lora_name of type {type(lora_name).__name__}")
    if lora_id is not None and not lora_name:
        # Local hashes of adapter blocks are seeded by the adapter's name (DESIGN §1);
        # without it they would pose as base-model blocks and mislead routing.
        raise _Skip(Issue.LORA_WITHOUT_NAME, f"lora_id {lora_id} without lora_name")
    tokens_hashes = local_hashes(token_ids, block_size, lora_name)
    seen_tiers.add(tier)
    return SourceStored(tier, dp_rank, parent, hashes, tuple(tokens_hashes))


@dataclass(slots=True)
class BridgeStats:
    messages: int = 0  # engine messages handled (live and replayed)
    events: int = 0  # engine events turned into source events
    replayed: int = 0  # messages recovered through the replay endpoint


class ZmqEngineBridge:
    """Subscribes to one engine publisher and feeds ``sink``. Single-threaded: call
    :meth:`poll` from the worker loop (or :meth:`handle_frames` with frames you got)."""

    def __init__(
        self, options: BridgeOptions, sink: SourceEventSink, context: zmq.Context | None = None
    ) -> None:
        self.options = options
        self._sink = sink
        self._ctx = context or zmq.Context.instance()
        self._sub: zmq.Socket | None = None
        self._expected: int | None = None  # next engine sequence number
        self._seen_tiers: dict[int, set[Tier]] = {}
        self.stats = BridgeStats()
        #: Skipped / missing input by reason.
        self.issues: Counter[Issue] = Counter()

    # ------------------------------------------------------------------ sockets

    def connect(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.options.rcvhwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.options.topic)
        try:
            sub.connect(self.options.endpoint)
        except zmq.ZMQError as exc:
            sub.close(linger=0)
            raise EngineBridgeError(f"cannot connect to engine endpoint {self.options.endpoint!r}: {exc}") from None
        self._sub = sub

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    def poll(self, timeout_ms: int, max_messages: int = 1024) -> int:
        """Handle what arrives within ``timeout_ms`` (at most ``max_messages``,
        without waiting once one is there); returns how many were handled."""
        sub = self._sub
        if sub is None:
            raise EngineBridgeError("bridge is not connected (call connect())")
        if not sub.poll(timeout_ms, zmq.POLLIN):
            return 0
        n = 0
        while n < max_messages:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.handle_frames(frames)
            n += 1
        return n

    # ------------------------------------------------------------------ input

    def handle_frames(self, frames: Sequence[bytes]) -> None:
        """One engine message: ``[topic, seq, payload]``."""
        if len(frames) != 3 or len(frames[1]) != 8:
            shape = [len(f) for f in frames]
            self._issue(Issue.MALFORMED_FRAME, f"frame sizes {shape}, expected [topic, 8-byte seq, payload]")
            return
        seq = int.from_bytes(frames[1], "big")
        expected = self._expected
        if expected is not None and seq != expected:
            if seq > expected:
                self._gap(expected, seq)
            else:
                self._restart(seq, expected)
        self._expected = seq + 1
        self.handle_payload(frames[2])

    def handle_payload(self, payload: bytes) -> None:
        """One msgpack ``EventBatch`` (array or map form)."""
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            self._issue(Issue.MALFORMED_PAYLOAD, f"not msgpack: {type(exc).__name__} {exc}")
            return
        if isinstance(batch, list) and len(batch) >= 2:
            events, rank = batch[1], batch[2] if len(batch) > 2 else None
        elif isinstance(batch, dict):
            events, rank = batch.get("events"), batch.get("data_parallel_rank")
        else:
            self._issue(Issue.MALFORMED_PAYLOAD, f"batch is a {type(batch).__name__}")
            return
        if rank is None:
            rank = self.options.default_dp_rank
        if not isinstance(events, list) or type(rank) is not int or rank < 0:
            self._issue(Issue.MALFORMED_PAYLOAD, "batch needs an events array and a rank >= 0")
            return
        self.stats.messages += 1
        seen = self._seen_tiers.setdefault(rank, set())
        sink = self._sink
        for ev in events:
            try:
                converted = convert_event(ev, rank, seen)
            except _Skip as skip:
                self._issue(skip.issue, str(skip))
                continue
            self.stats.events += 1
            for source_event in converted:
                sink.on_source_event(source_event)

    def _issue(self, issue: Issue, detail: str, count: int = 1) -> None:
        first = issue not in self.issues
        self.issues[issue] += count
        (log.warning if first else log.debug)("engine_input_issue", issue=issue.value, detail=detail)

    # ------------------------------------------------------------------ gaps

    def _gap(self, expected: int, seq: int) -> None:
        missing = seq - expected
        self._issue(Issue.GAP, f"engine messages {expected}..{seq - 1} missed", missing)
        recovered = self._replay(expected, seq) if self.options.replay_endpoint else 0
        if recovered < missing:
            self._issue(
                Issue.UNRECOVERED, f"{missing - recovered} of {missing} missed messages not replayed", missing - recovered
            )

    def _replay(self, start: int, stop: int) -> int:
        """Ask the engine's replay endpoint for messages ``start``..``stop - 1`` and
        handle them in order; returns how many arrived."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        got = 0
        try:
            dealer.connect(self.options.replay_endpoint)  # type: ignore[arg-type]
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            next_seq = start
            while dealer.poll(self.options.replay_timeout_ms, zmq.POLLIN):
                frames = dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._issue(Issue.MALFORMED_FRAME, "replay reply is not [b'', seq, payload]")
                    continue
                seq = int.from_bytes(frames[1], "big")
                if seq == _END_SEQ:
                    break
                # Only the missing range, in order: a hole in the engine's buffer stays a hole.
                if next_seq <= seq < stop:
                    self.handle_payload(frames[2])
                    got += 1
                    next_seq = seq + 1
            else:
                log.warning("engine_replay_timeout", endpoint=self.options.replay_endpoint, start=start)
        finally:
            dealer.close(linger=0)
        self.stats.replayed += got
        return got

    def _restart(self, seq: int, expected: int) -> None:
        """The sequence went backwards: a new engine process whose cache starts empty.
        Everything the old one reported is gone."""
        self._issue(Issue.ENGINE_RESTART, f"sequence {seq} after {expected - 1}")
        for rank, tiers in self._seen_tiers.items():
            for tier in sorted(tiers, key=list(Tier).index):
                self._sink.on_source_event(SourceCleared(tier, rank))
