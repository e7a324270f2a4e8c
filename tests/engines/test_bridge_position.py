"""What a bridge knows of the engine's sequence: with no position it reads the engine's
replay buffer from the start (an idle engine's blocks are known at once), and a
restarted engine is told from the same one by the bytes of its messages even when
nothing reconnects (a ZMQ forwarder between engine and bridge)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import zmq

from kvstream.router.index import TierOverlap
from kvstream.tools.procs import free_port
from kvstream.worker.zmq_bridge import Endpoint, Issue

from .conftest import WAIT_S, Env, Rig, eventually, tokens
from .engines import EngineKit
from .test_bridge_restart import worker_cmd

T = tokens(6)


def test_worker_next_to_an_idle_engine_knows_its_blocks(env: Env, engine: EngineKit) -> None:
    """The engine cached blocks before the worker started and publishes nothing after:
    its replay buffer holds them, and the routers must know them without waiting."""
    r = Rig(env, engine)
    try:
        r.publish(engine.stored([1, 2], None, T[:32]))
        r.publish(engine.stored([3], 2, T[32:48]), engine.stored([1], None, T[:16], medium=engine.host_medium))
        r.wait_sent()
        r.start_worker()
        eventually(lambda: r.overlap(T), TierOverlap(device=3))  # no engine message since
        assert not r.problems() and r.node.bridge.stats.replayed == 2
    finally:
        r.__exit__()


def test_history_the_buffer_no_longer_holds_is_counted(env: Env, engine: EngineKit) -> None:
    r = Rig(env, engine, publisher_kw={"buffer_steps": 2})
    try:
        roots = [tokens(1, 10_000 * (i + 1)) for i in range(4)]
        for i, toks in enumerate(roots):
            r.publish(engine.stored([100 + i], None, toks))
        r.wait_sent()
        node = r.start_worker()
        eventually(lambda: [r.overlap(t) for t in roots], [TierOverlap()] * 2 + [TierOverlap(device=1)] * 2)
        assert node.bridge.issues[Issue.UNRECOVERED] == 2
    finally:
        r.__exit__()


def test_worker_killed_before_its_first_checkpoint(env: Env, engine: EngineKit, tmp_path: Path) -> None:
    """`kvstream worker --state-dir` killed (SIGKILL) before any checkpoint restarts under
    a new epoch, which wipes what the replicas knew of it; the idle engine's buffer gives
    its blocks back at once."""
    r = Rig(env, engine)
    state = tmp_path / "state"
    cmd = worker_cmd(r, state)
    cmd[cmd.index("--checkpoint-s") + 1] = "3600"
    envvars = {**os.environ, "KVSTREAM_TOPICS__PREFIX": env.settings.topics.prefix}
    procs: list[subprocess.Popen[str]] = []

    def start() -> None:
        procs.append(subprocess.Popen(cmd, env=envvars, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))

    try:
        start()
        r.publish(engine.stored([1, 2], None, T[:32]))
        r.publish(engine.stored([3], 2, T[32:48]))
        nudge_until(r, lambda: r.overlap(T), TierOverlap(device=3))
        epoch = r.epoch()
        procs[-1].send_signal(signal.SIGKILL)
        procs[-1].wait(30)
        start()
        eventually(lambda: r.epoch() != epoch, True)
        eventually(lambda: r.overlap(T), TierOverlap(device=3))  # the engine publishes nothing
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        r.stop_engine()


def nudge_until(r: Rig, fn: Callable[[], object], expected: object, timeout: float = WAIT_S) -> None:
    """Keep the engine publishing (empty batches) until ``fn()`` is ``expected``: a late
    subscriber learns the sequence from them (ZMQ's slow joiner)."""
    deadline = time.monotonic() + timeout
    while fn() != expected and time.monotonic() < deadline:
        r.publish()
        time.sleep(0.2)
    assert fn() == expected


class Forwarder:
    """A ZMQ forwarder (XSUB → XPUB, zmq.proxy_steerable) between an engine's publisher
    and the bridge, as a sidecar proxy would be: the bridge's connection to it stays up
    while the engine behind it restarts."""

    def __init__(self, upstream: str, port: int) -> None:
        self.ctx = zmq.Context()
        self.xsub = self.ctx.socket(zmq.XSUB)
        self.xsub.connect(upstream)
        self.xpub = self.ctx.socket(zmq.XPUB)
        self.xpub.bind(f"tcp://127.0.0.1:{port}")
        self.control = self.ctx.socket(zmq.PAIR)
        self.control.bind("inproc://forwarder-control")
        self._steer = self.ctx.socket(zmq.PAIR)
        self._steer.connect("inproc://forwarder-control")
        self.thread = threading.Thread(
            target=zmq.proxy_steerable, args=(self.xsub, self.xpub, None, self.control), daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self._steer.send(b"TERMINATE")
        self.thread.join(10)
        for sock in (self.xsub, self.xpub, self.control, self._steer):
            sock.close(linger=0)
        self.ctx.term()


def test_engine_restart_behind_a_forwarder(env: Env, engine: EngineKit) -> None:
    """The new engine's low numbers come through the same connection: they are not
    duplicates (their bytes differ from what was applied), the old blocks go."""
    r = Rig(env, engine)
    port = free_port()
    fwd = Forwarder(f"tcp://127.0.0.1:{r.base}", port)
    bridge = replace(r.options.bridge, endpoints=(Endpoint(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{r.replay_base}"),))
    r.options = replace(r.options, bridge=bridge)
    try:
        r.start_worker()
        host = engine.host_medium
        r.publish(engine.stored([1, 2], None, T[:32]), engine.stored([1], None, T[:16], medium=host))
        for _ in range(5):
            r.publish()  # the old engine got further than the new one will
        nudge_until(r, lambda: r.overlap(T), TierOverlap(device=2))
        r.stop_engine()
        r.start_engine()  # a new process on the same ports: numbers from 0 again
        r.publish(engine.stored([5], None, T[:16]))
        r.publish(engine.stored([6], 5, T[16:32]))
        r.publish(engine.stored([7], 6, T[32:48]))
        nudge_until(r, lambda: r.overlap(T), TierOverlap(device=3))
        assert r.overlap(T[16:]) == TierOverlap()  # nothing of the old process is left
        assert r.node.bridge.issues[Issue.ENGINE_RESTART] == 1
    finally:
        r.__exit__()
        fwd.close()
