"""Fixtures of the emulator suite: ``kvstream emulate`` as a real process on loopback
ports, and vLLM's own KV-event classes from the pinned wheel (tests/engines/engines.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from engines.engines import EngineKit, kit

from kvstream.tools.procs import free_port_run

KVSTREAM = str(Path(sys.executable).with_name("kvstream"))
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Emulator:
    """One running ``kvstream emulate``: its URL and KV-event endpoints."""

    proc: subprocess.Popen[str]
    port: int
    events: str
    replay: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as resp:
            return resp.read().decode()

    def metric(self, name: str, engine: int | None = None) -> float:
        """The value of a sample of /metrics, summed over label sets (those of one DP rank
        with ``engine``)."""
        total, seen = 0.0, False
        for line in self.get("/metrics").splitlines():
            if line.startswith((name + "{", name + " ")) and (engine is None or f'engine="{engine}"' in line):
                total += float(line.rsplit(" ", 1)[1])
                seen = True
        assert seen, f"{name} not in /metrics"
        return total


def start_emulator(*args: str, ranks: int = 2) -> Emulator:
    """``ranks``: the DP ranks' room on the KV-event ports (rank r adds r to each)."""
    base = free_port_run(1 + 2 * ranks)  # HTTP, then the PUB and the ROUTER ports of each rank
    events, replay = f"tcp://127.0.0.1:{base + 1}", f"tcp://127.0.0.1:{base + 1 + ranks}"
    cmd = [KVSTREAM, "emulate", "--port", str(base), "--kv-events-endpoint", events,
           "--kv-events-replay-endpoint", replay, *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    emu = Emulator(proc, base, events, replay)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"kvstream emulate exited: {proc.stdout.read() if proc.stdout else ''}")
        try:
            emu.get("/health")
            return emu
        except OSError:
            assert time.monotonic() < deadline, "kvstream emulate never answered /health"
            time.sleep(0.1)


def stop_emulator(emu: Emulator) -> str:
    emu.proc.send_signal(signal.SIGTERM)
    try:
        out, _ = emu.proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        emu.proc.kill()
        out, _ = emu.proc.communicate(timeout=30)
    return out


@pytest.fixture
def emulator_factory() -> Iterator[Callable[..., Emulator]]:
    """Start emulators with extra flags; every one is stopped (and must exit cleanly)."""
    started: list[Emulator] = []

    def make(*args: str, ranks: int = 2) -> Emulator:
        emu = start_emulator(*args, ranks=ranks)
        started.append(emu)
        return emu

    yield make
    for emu in started:
        out = stop_emulator(emu)
        assert emu.proc.returncode == 0, out
        assert "Traceback" not in out, out


@pytest.fixture(scope="session")
def vllm() -> EngineKit:
    return kit("vllm")


class EventTap:
    """A SUB socket on an emulator's KV events, decoding with vLLM's ``KVEventBatch``."""

    def __init__(self, vllm: EngineKit, endpoint: str) -> None:
        self.decoder = msgspec.msgpack.Decoder(type=vllm.mod.KVEventBatch)
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        time.sleep(0.3)  # ZMQ's slow joiner: let the subscription reach the publisher

    def batches(self, timeout: float = 2.0) -> list[tuple[int, Any]]:
        """(sequence, decoded batch) of every message until ``timeout`` s of silence."""
        out = []
        while self.sock.poll(int(timeout * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b""
            out.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def tap_factory(vllm: EngineKit) -> Iterator[Callable[[str], EventTap]]:
    """Taps on emulators' KV events, closed at the end."""
    taps: list[EventTap] = []

    def make(endpoint: str) -> EventTap:
        taps.append(EventTap(vllm, endpoint))
        return taps[-1]

    yield make
    for t in taps:
        t.close()
