"""KV events on the wire exactly as vLLM 0.33's ``ZmqEventPublisher`` sends them.

PUB frames: ``(topic, sequence as 8 bytes big-endian, msgpack payload)``; the payload is a
``KVEventBatch`` (kvstream.emulator.kv_wire), an array ``[ts, events, data_parallel_rank]``
whose events are maps tagged by ``type``. The replay ROUTER answers a request
``(identity, b"", start sequence)`` with every buffered batch from that sequence on,
``(identity, b"", topic, seq, payload)``, then the end marker ``(identity, b"", b"", -1,
b"")``; the buffer keeps the last ``buffer_steps`` batches. Endpoints are bound (the
engine is the server side) and their port offset by the DP rank, as vLLM does.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from itertools import count
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvstream.emulator.errors import EmulatorConfigError
from kvstream.emulator.kv_wire import EventBatch, KvEvent
from kvstream.emulator.options import KvEventsOptions
from kvstream.logs import get_logger

_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_log = get_logger(__name__)


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's DP-rank offset: a tcp port grows by the rank (0 stays 0), inproc gets a suffix."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return endpoint if port == "0" else f"{base}:{int(port) + rank}"


class KvEventPublisher:
    """Started inside the engine's event loop: ``publish`` sends one batch now (PUB never
    blocks: past its high-water mark ZMQ drops, as for vLLM), replays run as a task."""

    def __init__(self, options: KvEventsOptions, rank: int) -> None:
        self.options = options
        self.rank = rank
        # PUB is a plain socket (a send never waits); the replay ROUTER is awaited.
        self._ctx = zmq.asyncio.Context.instance()
        self._sync_ctx = zmq.Context.instance()
        self._topic = options.topic.encode()
        self._seq = count()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=options.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._pub = self._sync_ctx.socket(zmq.PUB)
        self._pub.set_hwm(options.hwm)
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        try:
            self.endpoint = self._bind(self._pub, offset_endpoint(options.endpoint, rank))
            if options.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (options.buffer_steps + 1))
                self.replay_endpoint: str | None = self._bind(
                    self._replay, offset_endpoint(options.replay_endpoint, rank))
            else:
                self.replay_endpoint = None
        except EmulatorConfigError:
            self.close()
            raise

    @staticmethod
    def _bind(sock: zmq.Socket[Any], endpoint: str) -> str:
        # vLLM's wildcard form binds every interface; tcp://*:port is accepted as such.
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise EmulatorConfigError(f"cannot bind the KV-event socket on {endpoint}: {exc}") from None
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        if self._replay is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[KvEvent]) -> None:
        seq = next(self._seq)
        payload = self._encoder.encode(EventBatch(time.time(), list(events), self.rank))
        seq_bytes = seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart((self._topic, seq_bytes, payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # no subscriber keeps up: dropped as PUB drops; the replay buffer has it
        self._buffer.append((seq, payload))

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = await self._replay.recv_multipart()
                if len(frames) != 3:
                    _log.warning("kv_events.bad_replay_request", frames=len(frames))
                    continue
                ident, _, start = frames
                first = int.from_bytes(start, "big")
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        await self._replay.send_multipart((ident, b"", self._topic, seq.to_bytes(8, "big"), payload))
                await self._replay.send_multipart((ident, b"", b"", _END_SEQ, b""))
            except zmq.ZMQError as exc:
                # One subscriber's failed replay must not end replays for the others.
                _log.warning("kv_events.replay_failed", error=str(exc))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
