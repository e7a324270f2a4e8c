"""Load sharing between replicas through ``kvstream.active`` (DESIGN.md §6).

Each replica publishes the load ops of the requests it routes (add, prefill done,
free) and applies its peers', so that every replica's active-request view covers the
fleet. A ``prefill_done`` or ``free`` that reaches a replica other than the one that
routed the request (a load-balanced client) is applied on the owner's behalf and
published with the sender marked. At start, load is rebuilt from the topic's last
request TTL (kvstream.replica.active_codec.load_window_start_ms). Two running instances under one ``replica_id`` would stop
sharing load without a word: the one that started later gives up.

The replicas whose ops came within the last minute are the ones routing now: each keeps
its own part of a tie between candidates (kvstream.router.Router.split_ties), so that
requests reaching several replicas at once do not all go to one idle worker.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from confluent_kafka import OFFSET_END, Consumer, TopicPartition

from kvstream.events.errors import DecodeError
from kvstream.kafka.config import consumer_config
from kvstream.kafka.metadata import topic_partitions
from kvstream.kafka.producer import CountingProducer
from kvstream.logs import get_logger
from kvstream.replica.active_codec import ActiveOpCodec, load_window_start_ms
from kvstream.replica.errors import AmbiguousRequestError
from kvstream.replica.metrics import ReplicaMetrics
from kvstream.replica.pacer import Pacer
from kvstream.replica.request_ids import scoped, unscoped
from kvstream.replica.supervisor import Supervisor
from kvstream.router import Router
from kvstream.router.active import ActiveOp, AddRequest, FreeRequest
from kvstream.router.errors import RouterError, UnknownRequestError
from kvstream.settings import Settings

log = get_logger(__name__)

#: On a load op: which running instance of a replica id sent it ("<start ms>:<uuid>").
INSTANCE_HEADER = "kvstream-instance"
#: On an active op that a replica published for the peer that owns the request.
SENDER_HEADER = "kvstream-sender"
#: A replica with no load op for this long (seconds, by its ops' clock) is not routing.
ROUTING_WINDOW_S = 60.0


class LoadSharing:
    """One replica's side of ``kvstream.active``: :meth:`run` is its thread."""

    def __init__(
        self,
        settings: Settings,
        replica_id: str,
        router: Router,
        lock: AbstractContextManager[Any],
        codec: ActiveOpCodec,
        producer: CountingProducer,
        share_window_s: float,
        metrics: ReplicaMetrics,
        supervisor: Supervisor,
        stop: threading.Event,
    ) -> None:
        self._settings = settings
        self._topic = settings.topics.name("active")
        self.replica_id = replica_id
        self._router = router
        self._lock = lock
        self._codec = codec
        self._producer = producer
        self._metrics = metrics
        self._supervisor = supervisor
        self._stop = stop
        #: This process's instance of ``replica_id``: (start, random) orders two of them.
        self._instance = (int(time.time() * 1000), uuid.uuid4().hex)
        self._instance_tag = f"{self._instance[0]}:{self._instance[1]}".encode()
        #: Client id → the peer replicas with an active request of that id.
        self._peer_owners: dict[str, set[str]] = {}
        #: Peer replica id → the time of its latest load op: the replicas routing now.
        self._routing: dict[str, float] = {}
        self._split = (0, 1)
        metrics.routing_replicas.set(1)
        self._pacer: Pacer[tuple[bytes, bytes, list]] = Pacer(self._produce, f"{replica_id}-ops", share_window_s)

    def run(self) -> None:
        consumer = Consumer(consumer_config(self._settings, **{"auto.offset.reset": "latest"}))
        try:
            parts = topic_partitions(consumer, self._topic, 30)
            if not parts:
                log.error("active topic missing; load is not shared", topic=self._topic)
                return
            since_ms = load_window_start_ms(int(time.time() * 1000), self._router.config)
            tps = consumer.offsets_for_times([TopicPartition(self._topic, p, since_ms) for p in parts], timeout=30)
            consumer.assign([
                tp if tp.offset >= 0 else TopicPartition(self._topic, tp.partition, OFFSET_END) for tp in tps
            ])
            checked = time.monotonic()
            while not self._stop.is_set():
                # Wait for one op, then take what is already there: consume(n, t) waits for
                # n ops or t, and a peer's op 100 ms late routes on a load 100 ms old.
                msgs = consumer.consume(1, 0.1)
                if msgs:
                    msgs += consumer.consume(499, 0)
                for m in msgs:
                    if m.error() is not None:
                        continue
                    self._apply_peer_op(m.value(), m.headers(), m.timestamp()[1])
                if time.monotonic() - checked >= 1.0:
                    checked = time.monotonic()
                    self._resplit()
        finally:
            consumer.close()

    def _apply_peer_op(self, value: bytes | None, headers: list | None = None, timestamp_ms: int = 0) -> None:
        if headers and (INSTANCE_HEADER, self._instance_tag) in headers:
            return  # this process's own op, applied when made (each op it shares comes back): no decoding
        try:
            if value is None:
                raise DecodeError("active op record has no value")
            owner, op = self._codec.decode(value)
        except DecodeError as exc:
            self._metrics.active_errors.labels(reason="undecodable").inc()
            log.warning("bad active op", error=str(exc))
            return
        # The op's sender: its owner, or the replica that took it on the owner's behalf.
        sender = next((v.decode(errors="replace") for k, v in headers or () if k == SENDER_HEADER), owner)
        if sender == self.replica_id:
            self._own_id_op(headers, timestamp_ms)  # ours (applied when made), or a clash
            return
        seen = self._routing.get(sender)
        self._routing[sender] = op.timestamp if seen is None else max(seen, op.timestamp)
        if seen is None:
            self._resplit()
        with self._lock:
            try:
                self._router.apply_active(op)
                self._metrics.active_ops.labels(source="peer").inc()
                self._metrics.active_op_lag.observe(max(0.0, time.time() - op.timestamp))
            except RouterError as exc:  # e.g. free of a request that already expired here
                self._metrics.active_errors.labels(reason=type(exc).__name__).inc()
                return
            if owner != self.replica_id:
                self._note_peer_request(owner, op)

    def _resplit(self) -> None:
        """This replica's part of a tie among the replicas routing now (itself and the
        peers whose last op is within ROUTING_WINDOW_S), in replica id order."""
        since = time.time() - ROUTING_WINDOW_S
        self._routing = {r: t for r, t in self._routing.items() if t >= since}
        names = sorted({self.replica_id, *self._routing})
        split = (names.index(self.replica_id), len(names))
        if split != self._split:
            with self._lock:
                self._router.split_ties(*split)
            self._split = split
            self._metrics.routing_replicas.set(len(names))
            log.info("replicas routing", replicas=names, part=split[0])

    def _own_id_op(self, headers: list | None, timestamp_ms: int) -> None:
        """A load op under this replica's id: ours, an earlier incarnation's (before this
        one started), or another replica's given the same id, which would silently stop
        the two sharing load. Of two such instances the one that started later gives up
        (``kvstream router`` exits non-zero with the reason); the other counts it."""
        tag = dict(headers or ()).get(INSTANCE_HEADER)
        if tag == self._instance_tag or timestamp_ms < self._instance[0] or self._supervisor.fatal is not None:
            return
        self._metrics.replica_id_conflicts.inc()
        start, _, nonce = (tag or b"0:").decode(errors="replace").partition(":")
        other = (int(start) if start.isdigit() else 0, nonce)
        reason = (f"another running replica uses replica_id {self.replica_id!r} (instance {other[0]}:{other[1]}): "
                  "every replica needs its own")
        if other < self._instance:
            self._supervisor.give_up(reason)
        else:
            log.error("replica id conflict: the other instance started later and gives up", reason=reason)

    def _note_peer_request(self, owner: str, op: ActiveOp) -> None:
        """Which replica owns each client id of the peers' active requests (for a
        prefill_done or free that reaches this replica instead of the owner)."""
        client_id = unscoped(op.request_id)
        if isinstance(op, AddRequest):
            self._peer_owners.setdefault(client_id, set()).add(owner)
            if len(self._peer_owners) > 2 * self._router.active_requests() + 1024:  # expired ones
                self._peer_owners = {
                    c: live for c, owners in self._peer_owners.items()
                    if (live := {o for o in owners if self._router.is_active(scoped(o, c))})
                }
        elif isinstance(op, FreeRequest):
            owners = self._peer_owners.get(client_id)
            if owners is not None:
                owners.discard(owner)
                if not owners:
                    del self._peer_owners[client_id]

    def share(self, op: ActiveOp, owner: str | None = None) -> None:
        """Publish a load op for the peer replicas; ``owner``: the replica whose
        request it is, when this one takes it on its behalf."""
        self._metrics.active_ops.labels(source="local").inc()
        headers = [(INSTANCE_HEADER, self._instance_tag)]
        if owner is not None:
            headers.append((SENDER_HEADER, self.replica_id.encode()))
        self._pacer.put((self._codec.encode(owner or self.replica_id, op), op.request_id.encode(), headers))

    def _produce(self, ops: list[tuple[bytes, bytes, list]]) -> None:
        # Three ops per relayed request: a poll after each would cost as much as the op.
        for value, key, headers in ops:
            self._producer.produce("active", self._topic, poll=False, value=value, key=key, headers=headers)

    def close(self) -> None:
        """Hand the ops that wait for their window to the producer (before its flush)."""
        self._pacer.close()

    def request_op(self, apply: Callable[[str], ActiveOp], request_id: str) -> None:
        """``apply`` (the router's prefill_done or free) to this replica's request
        ``request_id``, else to the one peer's that has it, and share the op."""
        owner = None
        with self._lock:
            try:
                op = apply(scoped(self.replica_id, request_id))
            except UnknownRequestError:
                owners = self._peer_owners.get(request_id, set())
                if len(owners) != 1:
                    if owners:
                        raise AmbiguousRequestError(
                            f"request {request_id!r} is active on several other replicas ({', '.join(sorted(owners))}): "
                            "send it to the replica that routed it"
                        ) from None
                    raise
                (owner,) = owners
                op = apply(scoped(owner, request_id))
                if isinstance(op, FreeRequest):
                    self._note_peer_request(owner, op)
        self.share(op, owner)
