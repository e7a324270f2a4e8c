"""ZMQ engine bridge against a real ZMQ publisher speaking vLLM's wire format, built
field by field with msgpack (DESIGN.md §3)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgpack
import pytest
import zmq

from kvstream.events.model import Tier
from kvstream.hashing import local_hashes
from kvstream.worker.consolidator import Anomaly, Consolidator, Mode
from kvstream.worker.zmq_bridge import BridgeOptions, Issue, ZmqEngineBridge
from .test_consolidator import Recorder

TOKENS = list(range(64))  # 4 blocks of 16


def stored(hashes, parent, tokens, block_size=16, lora_id=None, medium="GPU", lora_name=None):
    # Field order of vLLM's BlockStored (array_like msgspec struct, tag first).
    return ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name]


def removed(hashes, medium="GPU"):
    return ["BlockRemoved", hashes, medium]


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
        BridgeOptions(endpoint=engine.endpoint, replay_endpoint=engine.replay_endpoint, replay_timeout_ms=3000),
        cons,
        ctx,
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


def test_stores_and_removes_reach_the_consolidator(ctx):
    engine, bridge, cons, rec = start(ctx)
    try:
        local = local_hashes(TOKENS, 16)
        engine.send(batch([stored([-1, -2], None, TOKENS[:32])]))
        engine.send(batch([stored([7, 8], -2, TOKENS[32:], medium="CPU"), stored([9, 10], None, TOKENS[:32], medium="cpu")]))
        engine.send(batch([removed([-1], medium=None), ["AllBlocksCleared"]], rank=0))
        pump(bridge, lambda: bridge.stats.messages == 3)
        u = (1 << 64)
        assert rec.take() == [
            ("stored", 0, Tier.DEVICE, None, (u - 1, u - 2), tuple(local[:2])),
            # G2 continues a chain whose parent only G1 holds: the consolidator rejects
            # it (counted), since the G2 source never stored block 1.
            ("stored", 0, Tier.HOST_PINNED, None, (9, 10), tuple(local[:2])),
            ("removed", 0, Tier.DEVICE, (u - 1,)),
            # AllBlocksCleared: every tier the engine reported on this rank.
            ("removed", 0, Tier.DEVICE, (u - 2,)),
            ("cleared", 0),
        ]
        assert bridge.stats.events == 5
        assert cons.anomalies == {Anomaly.UNKNOWN_PARENT: 1}
        assert not bridge.issues
    finally:
        engine.close()
        bridge.close()


def test_map_form_lora_and_rank(ctx):
    """Releases without array_like send maps tagged under "type"; the rank comes from
    the batch; a LoRA name seeds the local hashes."""
    engine, bridge, cons, rec = start(ctx)
    try:
        ev = {
            "type": "BlockStored",
            "block_hashes": [11],
            "parent_block_hash": None,
            "token_ids": TOKENS[:16],
            "block_size": 16,
            "lora_id": 3,
            "medium": "GPU",
            "lora_name": "my-lora",
            "extra_keys": [None],
        }
        engine.send(msgpack.packb({"ts": 2.0, "events": [ev], "data_parallel_rank": 2}))
        # Older array form: no medium, no lora_name, trailing fields absent.
        engine.send(batch([["BlockStored", [12], None, TOKENS[16:32], 16, None]], rank=1))
        # Newest array form: extra_keys, group_idx...; group 1 (say, sliding-window
        # layers of a hybrid model) is not what the routers track.
        engine.send(
            batch(
                [
                    ["BlockStored", [13], None, TOKENS[:16], 16, None, "GPU", None, [None], 1, "sliding_window", 128],
                    ["BlockRemoved", [13], "GPU", 1],
                    ["BlockStored", [14], 12, TOKENS[32:48], 16, None, "GPU", None, [None], 0, "full_attention"],
                ],
                rank=1,
            )
        )
        pump(bridge, lambda: bridge.stats.messages == 3)
        assert rec.take() == [
            ("stored", 2, Tier.DEVICE, None, (11,), (7774427462321301335,)),
            ("stored", 1, Tier.DEVICE, None, (12,), tuple(local_hashes(TOKENS[16:32], 16))),
            ("stored", 1, Tier.DEVICE, 12, (14,), tuple(local_hashes(TOKENS[16:48], 16)[1:])),
        ]
        assert bridge.issues == {Issue.OTHER_KV_GROUP: 2}
    finally:
        engine.close()
        bridge.close()


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


def test_gap_without_replay_is_counted(ctx):
    engine, bridge, cons, rec = start(ctx)
    try:
        engine.send(batch([stored([1], None, TOKENS[:16])]))
        engine.send(batch([stored([2], 1, TOKENS[16:32])]), skip=True)
        engine.send(batch([stored([3], 2, TOKENS[32:48])]), skip=True)
        engine.send(batch([stored([4], None, TOKENS[48:64])]))
        pump(bridge, lambda: bridge.stats.messages == 2)
        assert bridge.issues == {Issue.GAP: 2, Issue.UNRECOVERED: 2}
        assert [e[4] for e in rec.take()] == [(1,), (4,)]
    finally:
        engine.close()
        bridge.close()


def test_gap_repaired_through_replay_endpoint(ctx):
    engine, bridge, cons, rec = start(ctx, replay=True)
    try:
        engine.send(batch([stored([1], None, TOKENS[:16])]))
        engine.send(batch([stored([2], 1, TOKENS[16:32])]), skip=True)
        engine.send(batch([stored([3], 2, TOKENS[32:48])]), skip=True)
        server = engine.serve_one_replay()
        engine.send(batch([stored([4], 3, TOKENS[48:64])]))
        pump(bridge, lambda: bridge.stats.messages == 4)
        server.join(5)
        assert bridge.issues == {Issue.GAP: 2}  # missed, then recovered in order
        assert bridge.stats.replayed == 2
        assert [(e[3], e[4]) for e in rec.take()] == [(None, (1,)), (1, (2,)), (2, (3,)), (3, (4,))]
        assert not cons.anomalies
    finally:
        engine.close()
        bridge.close()


def test_engine_restart_clears_what_it_reported(ctx):
    engine, bridge, cons, rec = start(ctx, mode=Mode.DEDUP)
    try:
        engine.send(batch([stored([1], None, TOKENS[:16]), stored([2], None, TOKENS[16:32], medium="DISK")]))
        engine.send(batch([stored([5], None, TOKENS[32:48])]), seq=0)  # a new engine process
        pump(bridge, lambda: bridge.stats.messages == 2)
        assert bridge.issues == {Issue.ENGINE_RESTART: 1}
        events = rec.take()
        assert events[-2:] == [("cleared", 0), ("stored", 0, Tier.DEVICE, None, (5,), tuple(local_hashes(TOKENS[32:48], 16)))]
        assert cons.block_count() == 1
    finally:
        engine.close()
        bridge.close()


def test_digest_hashes_fold_to_u64(ctx):
    """Releases whose block hashes are byte digests: folded to u64 by XXH3, the same
    digest always giving the same identity (so removes find their stores)."""
    import xxhash

    engine, bridge, cons, rec = start(ctx)
    try:
        digest = bytes(range(32))
        engine.send(batch([stored([digest], None, TOKENS[:16]), removed([digest])]))
        pump(bridge, lambda: bridge.stats.messages == 1)
        h = xxhash.xxh3_64_intdigest(digest)
        assert rec.take() == [
            ("stored", 0, Tier.DEVICE, None, (h,), tuple(local_hashes(TOKENS[:16], 16))),
            ("removed", 0, Tier.DEVICE, (h,)),
        ]
        assert not bridge.issues and not cons.anomalies
    finally:
        engine.close()
        bridge.close()
