"""ZMQ engine bridge (DESIGN.md §3): stock vLLM or SGLang KV-event streams in, source
events out (to the consolidator).

The sockets and sequence numbers are the engines' own (checked in tests/engines/
against their publishers at the pinned versions, vLLM 0.33.0 and SGLang 0.5.23); each
event is converted by :class:`~kvstream.worker.engine_events.EventConverter`:

- live: a ZMQ PUB multipart ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian
  counter per publisher (one publisher per DP rank, each on its own port), ``payload``
  msgpack of ``[ts, events, dp_rank]``;
- replay: a ROUTER that takes ``[b"", start_seq]`` from a DEALER and answers
  ``[b"", topic, seq, payload]`` per buffered message from ``start_seq`` on, then
  ``[b"", b"", -1, b""]`` (releases before the topic frame: the same without it).

Bad input is counted by reason (:class:`~kvstream.worker.engine_events.Issue`), logged
(the first of each kind as a warning), and skipped; it is never fatal.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import xxhash
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvstream.events.model import Tier
from kvstream.hashing import DEFAULT_BLOCK_SIZE
from kvstream.logs import get_logger
from kvstream.worker.engine_events import BlockResolver, EventConverter, Flavour, Issue, SkippedEvent
from kvstream.worker.errors import EngineBridgeError
from kvstream.worker.options import DEFAULTS
from kvstream.worker.source_events import SourceEventSink

log = get_logger(__name__)

#: -1 as signed 8 bytes, read unsigned: the replay's end marker.
_END_SEQ = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One engine publisher: one DP rank's PUB socket and its replay socket."""

    #: The PUB endpoint, e.g. ``tcp://127.0.0.1:5557``.
    endpoint: str
    #: The replay (ROUTER) endpoint; None: gaps are counted, not repaired.
    replay_endpoint: str | None = None
    #: Rank of batches that carry none.
    default_dp_rank: int = 0


@dataclass(frozen=True, slots=True)
class BridgeOptions:
    endpoints: tuple[Endpoint, ...]
    #: Subscription prefix (the engines' ``topic``, empty by default).
    topic: bytes = b""
    flavour: Flavour = Flavour.AUTO
    #: The routers' block size; events of another size are skipped (None: no check).
    block_size: int | None = DEFAULT_BLOCK_SIZE
    #: How long to wait for a replay to finish.
    replay_timeout_ms: int = 2000
    #: Receive high-water mark, in messages.
    rcvhwm: int = 1_000_000
    #: vLLM's offloading connector ``blocks_per_chunk``: one offload placeholder event
    #: (no tokens) names a chunk by its last block only. Not on the wire.
    offload_blocks_per_chunk: int = DEFAULTS.offload_blocks_per_chunk

    def __post_init__(self) -> None:
        if self.offload_blocks_per_chunk < 1:
            raise ValueError(f"offload_blocks_per_chunk must be >= 1, got {self.offload_blocks_per_chunk}")
        if not self.endpoints:
            raise ValueError("a bridge needs at least one engine endpoint")
        names = [e.endpoint for e in self.endpoints]
        if len(set(names)) != len(names):
            raise ValueError(f"engine endpoints repeat: {names}")


@dataclass(slots=True)
class BridgeStats:
    messages: int = 0  # engine messages handled (live and replayed)
    events: int = 0  # engine events turned into source events
    replayed: int = 0  # messages recovered through the replay endpoints


#: Applied messages remembered per endpoint to tell a duplicate (live after a replay)
#: from a restarted engine's message of the same number: more than a replay can
#: overlap the live stream by (what arrives while the buffer is read).
_RECENT = 4096


@dataclass(slots=True)
class _Stream:
    """One endpoint's sockets and sequence bookkeeping."""

    ep: Endpoint
    sub: zmq.Socket | None = None
    monitor: zmq.Socket | None = None
    handshakes: int = 0
    #: Next engine sequence number expected (None: nothing seen yet).
    expected: int | None = None
    #: XXH3 of the last payload applied: a restarted engine's message of that number
    #: differs, which is how a reconnection tells a new engine from the same one.
    last_digest: int = 0
    #: (number, XXH3) of the last ``_RECENT`` messages applied, at number % _RECENT: a
    #: number seen again is a duplicate only with the same bytes.
    recent: list[tuple[int, int] | None] = field(default_factory=lambda: [None] * _RECENT)
    ranks: set[int] = field(default_factory=set)


class ZmqEngineBridge:
    """Subscribes to one or more engine publishers (one per DP rank) and feeds ``sink``.
    Single-threaded: call :meth:`poll` from the worker loop.

    Engine sequence numbers start at 0 in every engine process and carry no process
    identity. So on every (re)connection to an endpoint, the bridge asks the engine's
    replay buffer for the last message it applied: the same bytes mean the same engine
    (and the rest of the reply is what it missed); anything else means a restarted
    engine (its caches are empty: every tier of its ranks is cleared, and its buffer is
    replayed from 0). Knowing no position (a new worker, or one that lost its state),
    it asks for the buffer from 0: an idle engine's blocks are known at once. Without a
    reconnection (a forwarder between engine and bridge), a restart shows in the
    numbers and bytes: a number seen again with other bytes, or a jump whose replay
    starts with other bytes than the last message applied."""

    def __init__(
        self,
        options: BridgeOptions,
        sink: SourceEventSink,
        resolver: BlockResolver | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.options = options
        self._sink = sink
        self._ctx = context or zmq.Context.instance()
        self._streams = [_Stream(ep) for ep in options.endpoints]
        self._by_socket: dict[zmq.Socket, _Stream] = {}
        self._monitors: dict[zmq.Socket, _Stream] = {}
        self._poller = zmq.Poller()
        self.converter = EventConverter(
            options.flavour, options.block_size, resolver, options.offload_blocks_per_chunk
        )
        self.stats = BridgeStats()
        #: Skipped / missing input by reason.
        self.issues: Counter[Issue] = Counter()
        #: Set when engine history was lost for good (the worker then resyncs).
        self.resync_reason: str | None = None

    # ------------------------------------------------------------------ state

    def positions(self) -> dict[str, tuple[int, int, list[int]]]:
        """Per endpoint seen: (next engine sequence number, digest of the last payload,
        the ranks it published)."""
        return {
            s.ep.endpoint: (s.expected, s.last_digest, sorted(s.ranks)) for s in self._streams if s.expected is not None
        }

    def restore(self, positions: Mapping[str, Sequence[Any]], converter_state: bytes | None) -> None:
        """Continue from a saved state: :meth:`connect` then checks that each engine is
        the same and replays its buffer from there."""
        for s in self._streams:
            if s.ep.endpoint in positions:
                expected, digest, ranks = positions[s.ep.endpoint]
                s.expected, s.last_digest, s.ranks = expected, digest, set(ranks)
        if converter_state is not None:
            self.converter.load(converter_state)

    # ------------------------------------------------------------------ sockets

    def connect(self) -> None:
        for s in self._streams:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, self.options.rcvhwm)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, self.options.topic)
            try:
                s.monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                sub.connect(s.ep.endpoint)
            except zmq.ZMQError as exc:
                sub.close(linger=0)
                self.close()
                raise EngineBridgeError(f"cannot connect to engine endpoint {s.ep.endpoint!r}: {exc}") from None
            s.sub = sub
            self._by_socket[sub] = s
            self._monitors[s.monitor] = s
            self._poller.register(sub, zmq.POLLIN)
            self._poller.register(s.monitor, zmq.POLLIN)
        for s in self._streams:
            self._resume(s)

    def close(self) -> None:
        for s in self._streams:
            if s.sub is not None:
                self._poller.unregister(s.sub)
                if s.monitor is not None:
                    self._poller.unregister(s.monitor)
                    s.sub.disable_monitor()
                    s.monitor.close(linger=0)
                    s.monitor = None
                s.sub.close(linger=0)
                s.sub = None
        self._by_socket.clear()
        self._monitors.clear()

    def poll(self, timeout_ms: int, max_messages: int = 1024) -> int:
        """Handle what arrives within ``timeout_ms`` (at most ``max_messages`` per
        endpoint, without waiting once one is there); returns how many were handled."""
        if not self._by_socket:
            raise EngineBridgeError("bridge is not connected (call connect())")
        n = 0
        for sock, _ in self._poller.poll(timeout_ms):
            stream = self._by_socket.get(sock)
            if stream is None:
                self._check_connection(self._monitors[sock])
                continue
            for _ in range(max_messages):
                # A reconnection is dealt with before any message that came through it.
                self._check_connection(stream)
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.handle_frames(frames, stream)
                n += 1
        return n

    def _check_connection(self, s: _Stream) -> None:
        mon = s.monitor
        while mon is not None and mon.poll(0):
            event = recv_monitor_message(mon)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                s.handshakes += 1
                if s.handshakes > 1:  # the first one is connect()'s, already resumed
                    self._resume(s)

    # ------------------------------------------------------------------ input

    def handle_frames(self, frames: Sequence[bytes], stream: _Stream | None = None) -> None:
        """One engine message: ``[topic, seq, payload]`` (of the first endpoint unless
        ``stream`` says)."""
        s = stream or self._streams[0]
        if len(frames) != 3 or len(frames[1]) != 8:
            shape = [len(f) for f in frames]
            self._issue(Issue.MALFORMED_FRAME, f"frame sizes {shape}, expected [topic, 8-byte seq, payload]")
            return
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        digest = xxhash.xxh3_64_intdigest(payload)
        if s.expected is not None and seq < s.expected:
            if s.recent[seq % _RECENT] == (seq, digest):
                # Already applied (it came through a replay too).
                self._issue(Issue.DUPLICATE, f"message {seq} already applied")
                return
            # A number seen before with other bytes (or too old to be a duplicate): a
            # new engine numbering from 0 again, seen without a reconnection (a ZMQ
            # forwarder or proxy keeps ours up across the engine's restart).
            self._restart(s)
        if seq > (s.expected or 0):
            # Engines number their messages from 0: a worker joining a running engine
            # (or one that missed messages) gets the rest from the replay buffer.
            self._gap(s, seq)
        self._apply(s, seq, payload, digest)

    def _apply(self, s: _Stream, seq: int, payload: bytes, digest: int | None = None) -> None:
        s.expected = seq + 1
        s.last_digest = xxhash.xxh3_64_intdigest(payload) if digest is None else digest
        s.recent[seq % _RECENT] = (seq, s.last_digest)
        self.handle_payload(payload, s)

    def handle_payload(self, payload: bytes, stream: _Stream | None = None) -> None:
        """One msgpack ``EventBatch`` ``[ts, events, dp_rank]`` (or its map form)."""
        s = stream or self._streams[0]
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
            rank = s.ep.default_dp_rank
        if not isinstance(events, list) or type(rank) is not int or rank < 0:
            self._issue(Issue.MALFORMED_PAYLOAD, "batch needs an events array and a rank >= 0")
            return
        self.stats.messages += 1
        s.ranks.add(rank)
        sink = self._sink
        conv = self.converter
        for ev in events:
            conv.unresolved = 0
            try:
                converted = conv.convert(ev, rank)
            except SkippedEvent as skip:
                self._issue(skip.issue, str(skip), skip.count)
                continue
            self.stats.events += 1
            for source_event in converted:
                sink.on_source_event(source_event)
            if conv.unresolved:
                self._issue(
                    Issue.UNRESOLVED_PLACEHOLDER,
                    f"rank {rank}: {conv.unresolved} offloaded blocks unknown to the device source "
                    "(enable vLLM's self-describing KV events)",
                    conv.unresolved,
                )

    def _issue(self, issue: Issue, detail: str, count: int = 1) -> None:
        first = issue not in self.issues
        self.issues[issue] += count
        (log.warning if first else log.debug)("engine_input_issue", issue=issue.value, detail=detail)

    # ------------------------------------------------------------------ gaps

    def _gap(self, s: _Stream, seq: int) -> None:
        """Live message ``seq`` came after a hole: from the next expected one (from 0
        when nothing was seen). With a replay endpoint the buffer fills it, from the
        last message applied, whose bytes tell the same engine from a restarted one
        that published more than we had seen."""
        start = s.expected or 0
        got = 0
        if s.ep.replay_endpoint:
            msgs = self._fetch(s, start - 1 if start else 0)
            if msgs and start and msgs[0][0] == start - 1:
                if xxhash.xxh3_64_intdigest(msgs[0][1]) != s.last_digest:
                    self._restart(s)
                    start = 0
                    msgs = self._fetch(s, 0)
                else:
                    msgs = msgs[1:]
            self._issue(Issue.GAP, f"{s.ep.endpoint}: engine messages {start}..{seq - 1} missed", seq - start)
            for rseq, payload in msgs or ():
                if rseq >= seq:
                    break
                # Only the missing range, in order: a hole in the buffer stays a hole.
                if rseq >= (s.expected or 0):
                    self._apply(s, rseq, payload)
                    got += 1
            self.stats.replayed += got
        else:
            self._issue(Issue.GAP, f"{s.ep.endpoint}: engine messages {start}..{seq - 1} missed", seq - start)
        if got < seq - start:
            self._lost(s, seq - start - got)

    def _lost(self, s: _Stream, count: int) -> None:
        self._issue(Issue.UNRECOVERED, f"{s.ep.endpoint}: {count} engine messages lost (not in the replay buffer)", count)
        self.resync_reason = f"{count} engine messages of {s.ep.endpoint} lost"

    def _resume(self, s: _Stream) -> None:
        """On every (re)connection: an engine we never heard from gives its buffer from
        the start (it may hold blocks and publish nothing for a long time); one we
        heard from is the same engine if its buffer holds our last message byte for
        byte (the rest is what we missed), else a new one (a restart)."""
        if not s.ep.replay_endpoint:
            return
        if s.expected is None:
            self._join(s)
            return
        last = s.expected - 1
        msgs = self._fetch(s, last)
        if msgs is None:
            return  # no answer: the live numbers and bytes will tell
        if msgs and msgs[0][0] == last and xxhash.xxh3_64_intdigest(msgs[0][1]) == s.last_digest:
            got = 0
            for rseq, payload in msgs[1:]:
                if rseq == s.expected:
                    self._apply(s, rseq, payload)
                    got += 1
            self.stats.replayed += got
            return
        if msgs and msgs[0][0] > last:
            # Our last message fell out of the buffer: what came between is lost (or
            # this is a new engine that published more than we had seen: the numbers
            # cannot tell, and the state is kept).
            if msgs[0][0] > s.expected:
                self._lost(s, msgs[0][0] - s.expected)
            for rseq, payload in msgs:
                self._apply(s, rseq, payload)
            self.stats.replayed += len(msgs)
            return
        self._restart(s)
        self._join(s)

    def _join(self, s: _Stream) -> None:
        """No position known (a new worker, or one that lost its state): the engine's
        history is its buffer from message 0; what fell out of it is counted lost."""
        msgs = self._fetch(s, 0)
        if not msgs:
            return  # nothing published yet, or no answer: the live numbers will tell
        first = msgs[0][0]
        if first > (s.expected or 0):
            self._lost(s, first - (s.expected or 0))
        for rseq, payload in msgs:
            if rseq >= (s.expected or 0):
                self._apply(s, rseq, payload)
        self.stats.replayed += len(msgs)

    def _fetch(self, s: _Stream, start: int) -> list[tuple[int, bytes]] | None:
        """The endpoint's buffered messages from ``start`` on, in order; None when the
        replay socket did not finish answering in time."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        topic = self.options.topic
        try:
            dealer.connect(s.ep.replay_endpoint)  # type: ignore[arg-type]
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(self.options.replay_timeout_ms, zmq.POLLIN):
                frames = dealer.recv_multipart()
                # [b"", topic, seq, payload] (current engines) or [b"", seq, payload].
                if len(frames) == 4 and len(frames[2]) == 8:
                    msg_topic, seq_bytes, payload = frames[1], frames[2], frames[3]
                elif len(frames) == 3 and len(frames[1]) == 8:
                    msg_topic, seq_bytes, payload = None, frames[1], frames[2]
                else:
                    self._issue(Issue.MALFORMED_FRAME, f"replay reply of {len(frames)} frames")
                    continue
                seq = int.from_bytes(seq_bytes, "big")
                if seq == _END_SEQ:
                    return out
                if msg_topic is None or msg_topic.startswith(topic):
                    out.append((seq, payload))
            log.warning("engine_replay_timeout", endpoint=s.ep.replay_endpoint, start=start)
            return None
        finally:
            dealer.close(linger=0)

    def _restart(self, s: _Stream) -> None:
        """A new engine process on this endpoint: its caches start empty (every tier:
        its host and disk caches died with it)."""
        self._issue(Issue.ENGINE_RESTART, f"{s.ep.endpoint}: a new engine process (after message {(s.expected or 0) - 1})")
        for rank in sorted(s.ranks):
            for ev in self.converter.cleared(rank, frozenset(Tier)):
                self._sink.on_source_event(ev)
        s.expected = 0
        s.recent = [None] * _RECENT
