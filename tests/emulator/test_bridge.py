"""``kvstream worker --engine vllm`` bridges the emulator unchanged: the emulated engines'
KV events reach a real broker, a replica folds them, sees each engine's blocks (and their
eviction) and routes a prompt sharing a prefix to the engine that holds it."""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest
from engines.conftest import Env, env, eventually  # noqa: F401 - the module's replica and topics

from kvstream.hashing import block_hashes
from kvstream.router.index import TierOverlap, WorkerKey
from kvstream.router.scheduler import SchedulerOverrides

from .conftest import KVSTREAM, Emulator

_ids = itertools.count(5_000_000 + random.randrange(1 << 20) * 1_000)
#: Fresh one-block prompts (token ids below the fallback vocabulary's 128,256).
_nudges = itertools.count(100_000, 16)


def overlap(env: Env, worker_id: int, toks: list[int]) -> TierOverlap:  # noqa: F811
    local, seqs = block_hashes(toks, 16)
    with env.replica.lock:
        found = env.replica.router.find_matches_by_tier(local, seqs)
    return found.get(WorkerKey(worker_id, 0), TierOverlap())


@pytest.fixture
def bridge(env: Env) -> Iterator[Callable[..., int]]:  # noqa: F811
    """Start `kvstream worker --engine vllm` on an emulator; returns its worker id."""
    procs: list[subprocess.Popen[str]] = []

    def start(emu: Emulator, mode: str = "dedup") -> int:
        wid = next(_ids)
        cmd = [KVSTREAM, "worker", "--engine", "vllm", "--worker-id", str(wid), "--bootstrap",
               env.settings.bootstrap, "--endpoint", emu.events, "--replay-endpoint", emu.replay,
               "--lease-ms", "600000", "--heartbeat-s", "1", "--mode", mode]
        envvars = {**os.environ, "KVSTREAM_TOPICS__PREFIX": env.settings.topics.prefix}
        procs.append(subprocess.Popen(cmd, env=envvars, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        return wid

    yield start
    for p in procs:
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out


def complete(emu: Emulator, prompt: list[int]) -> dict:
    status, body = emu.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert status == 200, body
    return body


def sees(env: Env, emu: Emulator, wid: int, toks: list[int], expected: TierOverlap) -> None:  # noqa: F811
    """Wait for the replica to fold the engine's events that far. A bridge that connected
    after the first messages learns of the gap from the next one and replays the rest:
    a fresh one-block prompt is such a next message."""
    deadline = time.monotonic() + 60
    while overlap(env, wid, toks) != expected and time.monotonic() < deadline:
        n = next(_nudges)
        complete(emu, list(range(n, n + 16)))
        time.sleep(0.3)
    eventually(lambda: overlap(env, wid, toks), expected)


def registered(env: Env, *wids: int) -> None:
    """Wait for the replica to fold the bridges' registrations: routing admits registered
    workers only, and a bridge registers once its engine's sockets are up."""
    eventually(lambda: set(wids) <= set(env.replica.registry.registrations()), True)


def test_the_bridge_carries_emulated_blocks_to_routing(
        env: Env, emulator_factory: Callable[..., Emulator], bridge: Callable[[Emulator], int]) -> None:  # noqa: F811
    a = emulator_factory("--speed", "20", "--num-gpu-blocks", "96", "--max-model-len", "512")
    b = emulator_factory("--speed", "20", "--num-gpu-blocks", "96", "--max-model-len", "512")
    wa, wb = bridge(a), bridge(b)
    shared = list(range(10_000, 10_128))  # 8 blocks
    complete(a, shared)
    complete(b, list(range(20_000, 20_128)))
    sees(env, a, wa, shared, TierOverlap(device=8))
    sees(env, b, wb, shared, TierOverlap())
    registered(env, wa, wb)
    allowed = SchedulerOverrides(allowed_workers=frozenset({wa, wb}))
    decision = env.replica.route(shared + list(range(7, 40)), query_only=True, overrides=allowed)
    assert decision.worker == WorkerKey(wa, 0)
    # The engine's own answer agrees: the prompt's prefix is cached there.
    assert complete(a, shared + list(range(7, 40)))["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
    # G1 fills up (96 blocks): the shared prefix is evicted on the engine, and so in the index.
    for k in range(12):
        complete(a, list(range(30_000 + k * 1000, 30_000 + k * 1000 + 128)))
    sees(env, a, wa, shared, TierOverlap())
    assert complete(a, shared)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_bridge_resolves_the_host_tier(
        env: Env, emulator_factory: Callable[..., Emulator], bridge: Callable[[Emulator], int]) -> None:  # noqa: F811
    """vLLM's default offload events name blocks by hash only: the bridge resolves them from
    the engine's GPU events, so a prefix G1 lost but the host tier kept is still routed.
    In passthrough mode each tier is announced as the engine has it (in dedup, the
    default, a block stays announced once, at tier device, until no tier holds it)."""
    a = emulator_factory("--speed", "20", "--num-gpu-blocks", "24", "--num-cpu-blocks", "256",
                         "--max-model-len", "256")
    b = emulator_factory("--speed", "20", "--num-gpu-blocks", "24", "--max-model-len", "256")
    wa, wb = bridge(a, "passthrough"), bridge(b, "passthrough")
    shared = list(range(11_000, 11_128))  # 8 blocks
    complete(a, shared)
    sees(env, a, wa, shared, TierOverlap(device=8))
    for k in range(3):  # 24 more blocks: G1 evicts the shared prefix, the host tier keeps it
        complete(a, list(range(40_000 + k * 1000, 40_000 + k * 1000 + 128)))
    sees(env, a, wa, shared, TierOverlap(host_pinned=8))
    complete(b, list(range(60_000, 60_128)))
    sees(env, b, wb, shared, TierOverlap())
    registered(env, wa, wb)
    allowed = SchedulerOverrides(allowed_workers=frozenset({wa, wb}))
    assert env.replica.route(shared + [1, 2, 3], query_only=True, overrides=allowed).worker == WorkerKey(wa, 0)
    assert complete(a, shared)["usage"]["prompt_tokens_details"]["cached_tokens"] == 112  # loaded from the host
