"""``kvstream router`` under systemd socket activation: it serves the listening socket it
is passed (LISTEN_FDS, LISTEN_PID), so a restart refuses no connection: what comes while
the router is down waits in the socket's backlog and is served by the next one."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvstream.settings import Settings
from kvstream.tools.procs import free_port, socket_activated

from tests.faults.helpers import KVSTREAM, ROOT, router_env, stop_process, wait_http


def _activated(fd: int, args: list[str], env: dict[str, str], log: Path, fds: str = "1") -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            socket_activated([str(KVSTREAM), "router", *args], fd, fds),
            pass_fds=(fd,), env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
        )


@pytest.mark.kafka
def test_a_request_made_while_the_router_restarts_is_served_by_the_next_one(kafka_topics: Settings, tmp_path: Path) -> None:
    held = socket.create_server(("127.0.0.1", 0))  # what systemd holds across restarts
    url = f"http://127.0.0.1:{held.getsockname()[1]}"
    args = ["--bootstrap", str(kafka_topics.bootstrap), "--snapshot-dir", str(tmp_path / "snapshots")]
    env = router_env(kafka_topics) | {"KVSTREAM_LOG_LEVEL": "INFO"}
    with held:
        first = _activated(held.fileno(), args, env, tmp_path / "first.log")
        try:
            wait_http(f"{url}/readyz", 60, first)
        finally:
            first.kill()  # a crash: nothing closes the socket but the process's own fd
            first.wait()
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.get, f"{url}/healthz", timeout=60)
            time.sleep(0.5)
            assert not pending.done()  # connected, and waiting: no process serves the socket
            second = _activated(held.fileno(), args, env, tmp_path / "second.log")
            try:
                assert pending.result(timeout=60).status_code == 200
                wait_http(f"{url}/readyz", 60, second)
            finally:
                stop_process(second)
    assert second.returncode == 0, (tmp_path / "second.log").read_text()
    assert "serving" in (tmp_path / "second.log").read_text()


@pytest.mark.kafka
@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd's systemd-socket-activate is not installed")
def test_systemd_socket_activate_starts_the_router_on_a_first_connection_and_it_is_served(
        kafka_topics: Settings, tmp_path: Path) -> None:
    """systemd's own tool (not this suite's imitation): it listens, and on the first
    connection execs the router with the socket and LISTEN_FDS / LISTEN_PID /
    LISTEN_FDNAMES set as systemd sets them; that first request is answered."""
    port = free_port()
    env = router_env(kafka_topics)
    passed = [f for k in env if k.startswith("KVSTREAM_") or k in ("PATH", "HOME") for f in ("-E", k)]
    with open(tmp_path / "router.log", "ab") as out:
        proc = subprocess.Popen(
            ["systemd-socket-activate", "-l", f"127.0.0.1:{port}", *passed, str(KVSTREAM), "router",
             "--bootstrap", str(kafka_topics.bootstrap), "--snapshot-dir", str(tmp_path / "snapshots")],
            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
        )
    try:
        deadline = time.monotonic() + 10
        while True:  # until systemd-socket-activate listens (it starts nothing before)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "router.log").read_text()
                time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=60).status_code == 200
        wait_http(f"http://127.0.0.1:{port}/readyz", 60, proc)
    finally:
        stop_process(proc)
    assert proc.returncode == 0, (tmp_path / "router.log").read_text()


def test_a_passed_fd_that_is_not_one_listening_tcp_socket_is_refused_with_the_reason(tmp_path: Path) -> None:
    env = {k: v for k, v in router_env(Settings()).items() if not k.startswith("LISTEN_")}
    args = ["--bootstrap", "127.0.0.1:1", "--snapshot-dir", str(tmp_path / "snapshots")]
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))  # bound, never listening
    listening = socket.create_server(("127.0.0.1", 0))
    with udp, bound, listening, open(tmp_path / "a-file", "wb") as file:
        cases = [
            (file.fileno(), "1", "LISTEN_FDS=1 but fd 3 is not a socket"),
            (udp.fileno(), "1", "the socket passed on fd 3 (LISTEN_FDS) is not a listening TCP socket"),
            (bound.fileno(), "1", "the socket passed on fd 3 (LISTEN_FDS) is not a listening TCP socket"),
            (listening.fileno(), "2", "LISTEN_FDS=2: kvstream router serves on exactly one passed socket"),
        ]
        for n, (fd, fds, why) in enumerate(cases):
            log = tmp_path / f"{n}.log"
            proc = _activated(fd, args, env, log, fds)
            assert proc.wait(60) == 1, log.read_text()
            assert f"Error: {why}" in log.read_text()
