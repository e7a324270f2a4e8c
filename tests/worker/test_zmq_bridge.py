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
    """A hand-made publisher of bad input: an XPUB socket (a PUB that also reports
    subscriptions, so the test knows when the bridge listens) and a ROUTER replay
    socket that answers with whatever frames a test gives it."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0

    def wait_subscribed(self) -> None:
        assert self.pub.poll(5000), "bridge never subscribed"
        assert self.pub.recv()[0] == 1

    def send(self, payload: bytes) -> None:
        self.pub.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def serve_one_replay(self, replies: list[list[bytes]]) -> threading.Thread:
        def serve() -> None:
            assert self.router.poll(5000)
            client, empty, _start = self.router.recv_multipart()
            for frames in replies:
                self.router.send_multipart([client, empty, *frames])

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def start(ctx):
    engine = Engine(ctx)
    rec = Recorder()
    bridge = ZmqEngineBridge(
        BridgeOptions((Endpoint(engine.endpoint, engine.replay_endpoint),), replay_timeout_ms=3000),
        Consolidator(rec, Mode.PASSTHROUGH),
        context=ctx,
    )
    # A bridge with no position asks the buffer from 0 on connect: this engine has
    # published nothing yet (the end marker only).
    joined = engine.serve_one_replay([[b"", (-1).to_bytes(8, "big", signed=True), b""]])
    bridge.connect()
    joined.join(5)
    engine.wait_subscribed()
    return engine, bridge, rec


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
    engine, bridge, rec = start(ctx)
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




def test_malformed_replay_replies_are_counted(ctx):
    engine, bridge, rec = start(ctx)
    try:
        good = batch([["BlockStored", [2], None, TOKENS[:16], 16, None, "GPU"]])
        end = [b"", (-1).to_bytes(8, "big", signed=True), b""]
        server = engine.serve_one_replay([[b"x"], [b"", (0).to_bytes(8, "big"), good], end])
        engine.seq = 1  # message 0 was missed
        engine.send(batch([["BlockStored", [3], 2, TOKENS[16:32], 16, None, "GPU"]]))
        pump(bridge, lambda: bridge.stats.messages == 2)
        server.join(5)
        # The 3-frame reply form of older releases is read too; junk is counted.
        assert bridge.issues == {Issue.GAP: 1, Issue.MALFORMED_FRAME: 1}
        assert [e[4] for e in rec.take()] == [(2,), (3,)]
    finally:
        engine.close()
        bridge.close()
