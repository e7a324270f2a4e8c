"""Issue 26 (7): the small things a new user meets first — `kvstream --help` is quick and
imports no command, `--port 0` says which port it got, a taken port is one line before
anything starts, and Ctrl-C ends a command with 130."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstream.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _env(settings: Settings | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if settings is not None:
        env.update(KVSTREAM_BOOTSTRAP=settings.bootstrap or "", KVSTREAM_TOPICS__PREFIX=settings.topics.prefix)
    return env


def test_help_imports_no_command() -> None:
    code = ("import sys\nfrom kvstream.cli import main\nsys.argv = ['kvstream', '--help']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "heavy = [m for m in ('torch', 'kvstream.replica.replica', 'kvstream.tools.simulate.engine', 'confluent_kafka') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("router", "worker", "simulate", "bench", "config"):
        assert re.search(rf"^\s+{name}\s+\S", out.stdout, re.M), out.stdout


@pytest.mark.kafka
def test_router_port_zero_taken_port_and_ctrl_c(kafka_topics: Settings, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "kvstream.cli", "router"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([*cmd, "--port", str(port)], capture_output=True, text=True, env=_env(kafka_topics), timeout=120)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 1, lines
    assert f"cannot serve on 127.0.0.1:{port}: address already in use" in lines[0]
    proc = subprocess.Popen([*cmd, "--port", "0"], stderr=subprocess.PIPE, text=True, env=_env(kafka_topics))
    try:
        deadline = time.monotonic() + 60
        got = None
        while got is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "the router exited before serving"
            if (m := re.search(r"serving .*port=(\d+)", line)) is not None:
                got = int(m.group(1))
        assert got and got != 0, "the log names the port it got"
        with socket.create_connection(("127.0.0.1", got), timeout=5):
            pass
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
