"""ZMQ engine bridge against malformed input: frames, payloads and events that no engine
sends, built by hand (the engines' own publishers are driven in tests/engines/)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgpack
import pytest
import zmq

from kvstream.events.model import Tier
from kvstream.hashing import local_hashes
from kvstream.worker.consolidator import Consolidator, Mode
from kvstream.worker.zmq_bridge import BridgeOptions, Endpoint, Issue, ZmqEngineBridge
from .test_consolidator import Recorder

TOKENS = list(range(64))  # 4 blocks of 16


def batch(events, rank=0, ts=1.5):
    return msgpack.packb([ts, events, rank])


class Engine:
    """A stand-in engine process: an XPUB socket (a PUB that also reports
    subscriptions, so the test knows when the bridge listens) and an optional ROUTER
    replay endpoint serving a buffer the way vLLM's ``ZmqEventPublisher`` does."""

    def __init__(self, ctx: zmq.Context, replay: bool = False) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = None
        self.replay_endpoint = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0

    def wait_subscribed(self) -> None:
        assert self.pub.poll(5000), "bridge never subscribed"
        assert self.pub.recv()[0] == 1

    def send(self, payload: bytes, *, skip: bool = False, seq: int | None = None) -> None:
        """Publish (or, with ``skip``, only buffer, as if the subscriber lost it)."""
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        self.buffer.append((seq, payload))
        if not skip:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def serve_one_replay(self) -> threading.Thread:
        def serve() -> None:
            assert self.router.poll(5000)
            client, empty, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    self.router.send_multipart([client, empty, seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, empty, (-1).to_bytes(8, "big", signed=True), b""])

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def start(ctx, mode=Mode.PASSTHROUGH, replay=False):
    engine = Engine(ctx, replay=replay)
    rec = Recorder()
    cons = Consolidator(rec, mode)
    bridge = ZmqEngineBridge(
        BridgeOptions((Endpoint(engine.endpoint, engine.replay_endpoint),), replay_timeout_ms=3000),
        cons,
        context=ctx,
    )
    bridge.connect()
    engine.wait_subscribed()
    return engine, bridge, cons, rec


def pump(bridge: ZmqEngineBridge, done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"bridge did not get there: {bridge.stats} {bridge.issues}"
        bridge.poll(100)


def handled(bridge: ZmqEngineBridge) -> int:
    return bridge.stats.messages + sum(
        bridge.issues[i] for i in (Issue.MALFORMED_FRAME, Issue.MALFORMED_PAYLOAD)
    )


def test_malformed_input_is_counted_and_never_fatal(ctx):
    engine, bridge, cons, rec = start(ctx)
    try:
        engine.send_raw([b"", b"\x00" * 8])  # two frames
        engine.send_raw([b"", b"\x00\x01", batch([])])  # short sequence number
        engine.send(b"\xc1\xc1 not msgpack")
        engine.send(msgpack.packb("a string"))
        engine.send(msgpack.packb([1.0, "not a list", 0]))
        engine.send(
            batch(
                [
                    ["BlockEvicted", [1]],  # unknown tag
                    {"type": "Mystery"},  # unknown tag, map form
                    42,  # not an event
                    ["BlockStored", [1, 2], None, TOKENS[:16], 16, None, "GPU"],  # too few tokens
                    ["BlockStored", ["x"], None, TOKENS[:16], 16, None, "GPU"],  # bad hash
                    ["BlockStored", [1], None, TOKENS[:16], 0, None, "GPU"],  # bad block size
                    ["BlockStored", [1], None, TOKENS[:16], 16, None, "TAPE"],  # unknown medium
                    ["BlockStored", [1], None, TOKENS[:16], 16, 5, "GPU"],  # lora_id, no name
                    ["BlockRemoved"],  # missing hashes
                    ["BlockRemoved", [1], 7],  # medium not a string
                    ["BlockStored", [99], None, TOKENS[:16], 16, None, "GPU"],  # good
                ]
            )
        )
        pump(bridge, lambda: handled(bridge) == 6)
        assert dict(bridge.issues) == {
            Issue.MALFORMED_FRAME: 2,
            Issue.MALFORMED_PAYLOAD: 3,
            Issue.UNKNOWN_TAG: 2,
            Issue.MALFORMED_EVENT: 6,
            Issue.UNKNOWN_MEDIUM: 1,
            Issue.LORA_WITHOUT_NAME: 1,
        }
        assert rec.take() == [("stored", 0, Tier.DEVICE, None, (99,), tuple(local_hashes(TOKENS[:16], 16)))]
    finally:
        engine.close()
        bridge.close()


