"""A bridge that restarts (stopped, or killed outright) loses nothing that the engine's
replay buffer still holds: its state comes back from its RocksDB, the engines' buffers
supply what they published meanwhile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvstream.router.index import TierOverlap

from kvstream.worker.zmq_bridge import Issue

from .conftest import Env, Rig, eventually, tokens
from .engines import EngineKit

T = tokens(8)
KVSTREAM = str(Path(sys.executable).with_name("kvstream"))


def test_stopped_bridge_resumes_its_epoch(env: Env, engine: EngineKit, tmp_path: Path) -> None:
    r = Rig(env, engine, ranks=2, state_dir=tmp_path / "state")
    try:
        r.start_worker()
        r.publish(engine.stored([1, 2], None, T[:32]), rank=0)
        r.publish(engine.stored([1], None, T[:16]), rank=1)
        r.sees(T, TierOverlap(device=2), rank=0)
        r.sees(T, TierOverlap(device=1), rank=1)
        epoch = r.epoch()
        r.stop_worker()
        # The engine goes on while the bridge is away.
        r.publish(engine.stored([3], 2, T[32:48]), rank=0)
        r.publish(engine.removed([1]), rank=1)
        r.publish(engine.stored([4], 3, T[48:64]), rank=0)
        r.start_worker()
        r.publish(engine.stored([5], 4, T[64:80]), rank=0)
        r.sees(T, TierOverlap(device=5), rank=0)
        r.sees(T, TierOverlap(), rank=1)
        assert r.epoch() == epoch  # the same incarnation: no wipe, no republication
        assert r.node.publisher.stats.resyncs == 0
        with env.replica.lock:
            counters = env.replica.fold.counters
            assert not counters["epoch_without_cleared"] and not counters["event_id_gap"]
    finally:
        r.__exit__()


def worker_cmd(r: Rig, state_dir: Path) -> list[str]:
    cmd = [KVSTREAM, "worker", "--engine", r.engine.name, "--worker-id", str(r.worker_id),
           "--bootstrap", r.env.settings.bootstrap, "--mode", "passthrough", "--state-dir", str(state_dir),
           "--checkpoint-s", "0.2", "--lease-ms", "600000", "--heartbeat-s", "1"]
    for rank in range(r.ranks):
        cmd += ["--endpoint", f"tcp://127.0.0.1:{r.base + rank}", "--replay-endpoint", f"tcp://127.0.0.1:{r.replay_base + rank}"]
    return cmd


def test_killed_bridge_loses_nothing_the_engine_still_holds(env: Env, engine: EngineKit, tmp_path: Path) -> None:
    """`kvstream worker` killed with SIGKILL in the middle of a run, the engine going on
    meanwhile; the restarted worker republishes its state under a new epoch and then
    what the engine's buffer holds."""
    r = Rig(env, engine)
    state = tmp_path / "state"
    envvars = {**os.environ, "KVSTREAM_TOPICS__PREFIX": env.settings.topics.prefix}
    procs: list[subprocess.Popen[str]] = []

    def start() -> None:
        procs.append(subprocess.Popen(worker_cmd(r, state), env=envvars, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))

    def sees(expected: TierOverlap) -> None:
        # No in-process worker to sync with: keep the stream moving until the replica
        # has it (an empty batch shows a late subscriber the sequence).
        deadline = time.monotonic() + 60
        while r.overlap(T) != expected and time.monotonic() < deadline:
            r.publish()
            time.sleep(0.3)
        eventually(lambda: r.overlap(T), expected)

    try:
        start()
        chain = [engine.stored([1, 2], None, T[:32])]
        r.publish(*chain)
        sees(TierOverlap(device=2))
        time.sleep(0.5)  # let a checkpoint cover it (the assertion does not depend on it)
        procs[-1].send_signal(signal.SIGKILL)
        procs[-1].wait(30)
        r.publish(engine.stored([3, 4], 2, T[32:64]))
        r.publish(engine.removed([1, 2, 3, 4]), engine.stored([11, 12], None, T[:32], medium=engine.host_medium))
        r.publish(engine.stored([5], None, T[:16]))
        start()
        sees(TierOverlap(device=1, host_pinned=1))
        procs[-1].send_signal(signal.SIGTERM)
        out, _ = procs[-1].communicate(timeout=60)
        assert procs[-1].returncode == 0, out
        assert "bridge_state_restored" in out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        r.stop_engine()


def test_history_older_than_the_buffer_is_counted_and_resynced(env: Env, engine: EngineKit, tmp_path: Path) -> None:
    r = Rig(env, engine, state_dir=tmp_path / "state", publisher_kw={"buffer_steps": 3})
    try:
        r.start_worker()
        r.publish(engine.stored([1], None, T[:16]))
        r.sees(T, TierOverlap(device=1))
        r.stop_worker()
        roots = [tokens(1, 10_000 * (i + 1)) for i in range(8)]
        for i, toks in enumerate(roots):  # the buffer keeps the last 3 only
            r.publish(engine.stored([100 + i], None, toks))
        r.wait_sent()
        node = r.start_worker()
        r.sees(roots[-1], TierOverlap(device=1))
        assert [r.overlap(t) for t in roots[-3:]] == [TierOverlap(device=1)] * 3
        assert [r.overlap(t) for t in roots[:5]] == [TierOverlap()] * 5
        assert r.overlap(T) == TierOverlap(device=1)  # what the bridge had is kept
        assert node.bridge.issues[Issue.UNRECOVERED] == 5
        eventually(lambda: node.publisher.stats.resyncs, 1)  # a new epoch with the state
    finally:
        r.__exit__()
