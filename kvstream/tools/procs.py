"""The servers a benchmark starts (backends, peer routers, replicas): each in its own
process group with its output in a log file, on a loopback port that must be free, and
stopped with everything it started when its block ends, at interpreter exit, on Ctrl-C
and on SIGTERM/SIGHUP (turned into SystemExit, so that the blocks unwind)."""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx

HOST = "127.0.0.1"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_LIVE: set[ManagedProcess] = set()
_LIVE_LOCK = threading.Lock()
_HANDLERS_SET = False


def port_taken(port: int) -> bool:
    """Whether something holds ``port`` on the loopback address (binding without
    SO_REUSEADDR fails on a listening or lingering socket)."""
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return True
    return False


def free_port() -> int:
    """A loopback port that was free a moment ago (see :func:`free_port_run`)."""
    return free_port_run(1)


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive loopback ports that were free a moment ago (an
    engine's DP ranks each bind its endpoint's port + its rank), below the kernel's
    ephemeral range: a port in it can be taken meanwhile by any outgoing connection,
    and a client probing it before the server listens can be given that very port as
    its own, connect to itself and read its request back as the answer."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = 10_000 if low - n > 20_000 else 1024
    rng = random.Random()
    for _ in range(10_000):
        base = rng.randrange(first, low - n)
        with contextlib.ExitStack() as held:
            try:
                for p in range(base, base + n):
                    held.enter_context(socket.socket()).bind((HOST, p))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {n} consecutive free loopback ports below {low}")


def _stop_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proc in live:
        proc.stop()


def _exit_on(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    """Once, from the main thread: stop every live process at exit, and let SIGTERM and
    SIGHUP unwind like Ctrl-C does (where nobody else handles them)."""
    global _HANDLERS_SET
    if _HANDLERS_SET:
        return
    _HANDLERS_SET = True
    atexit.register(_stop_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _exit_on)


#: What systemd does for a socket-activated service (as ``systemd-socket-activate``): the
#: listening socket on fd 3, LISTEN_FDS and LISTEN_PID naming the process that then execs
#: the server (argv: the socket's fd here, LISTEN_FDS, the command).
_ACTIVATE = (
    "import os, sys\n"
    "fd = int(sys.argv[1])\n"
    "if fd != 3:\n    os.dup2(fd, 3)\n    os.close(fd)\n"
    "os.environ.update(LISTEN_FDS=sys.argv[2], LISTEN_PID=str(os.getpid()))\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n"
)


def socket_activated(cmd: Sequence[str], fd: int, fds: str = "1") -> list[str]:
    """``cmd`` started as systemd starts a socket-activated service with the socket ``fd``
    (run it with ``pass_fds=(fd,)``; ``fds``: the LISTEN_FDS it is told)."""
    return [sys.executable, "-c", _ACTIVATE, str(fd), fds, *cmd]


@dataclass(eq=False)
class ManagedProcess:
    """A started server: its own process group (the leader's pid), serving on ``port``."""

    name: str
    popen: subprocess.Popen[bytes]
    port: int
    log_path: Path
    _stopped: bool = field(default=False, repr=False)

    @classmethod
    def start(
        cls, name: str, cmd: Sequence[str], port: int, env: Mapping[str, str] | None = None,
        extra_ports: Sequence[int] = (), restart: bool = False, listening: socket.socket | None = None,
    ) -> ManagedProcess:
        """Run ``cmd`` (which will listen on ``port`` and ``extra_ports``); refused when a
        port is taken, unless ``restart``: the same server again on its own ports, which
        its killed predecessor's connections hold in TIME_WAIT for a while (servers bind
        with SO_REUSEADDR). ``listening``: the socket on ``port``, held by the caller and
        passed to ``cmd`` as systemd socket activation passes it (socket_activated)."""
        if listening is not None:
            cmd = socket_activated(cmd, listening.fileno())
        for p in () if restart or listening is not None else (port, *extra_ports):
            if port_taken(p):
                raise click.ClickException(f"{name}: port {p} on {HOST} is taken")
        _install_handlers()
        fd, log = tempfile.mkstemp(prefix=f"kvstream-{name.replace(':', '-')}-", suffix=".log")
        try:
            popen = subprocess.Popen(
                list(cmd), stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT,
                start_new_session=True, env=None if env is None else {**os.environ, **env},
                pass_fds=() if listening is None else (listening.fileno(),),
            )
        except OSError as exc:
            os.unlink(log)
            raise click.ClickException(f"{name}: cannot start {cmd[0]}: {exc}") from None
        finally:
            os.close(fd)
        proc = cls(name, popen, port, Path(log))
        with _LIVE_LOCK:
            _LIVE.add(proc)
        return proc

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:].strip()
        except OSError:
            return ""

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by the live processes of the group."""
        total = 0
        pgid = str(self.popen.pid)
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read()
            except OSError:  # gone meanwhile
                continue
            rest = stat[stat.rfind(")") + 2:].split()
            if rest[2] == pgid:
                total += int(rest[11]) + int(rest[12])
        return total / _CLOCK_TICKS

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM to the group, SIGKILL to what is left after ``grace`` seconds."""
        if self._stopped:
            return
        self._stopped = True
        pgid = self.popen.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.popen.wait(grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:  # what is left of the group: the leader past its grace, or children it left
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()
        with _LIVE_LOCK:
            _LIVE.discard(self)
        self.log_path.unlink(missing_ok=True)


def wait_http(proc: ManagedProcess, path: str, timeout: float) -> None:
    """Return once ``GET path`` answers 200; a clear error (with the server's log) when
    the process dies or the time runs out."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    with httpx.Client(timeout=2.0) as client:
        while True:
            if proc.popen.poll() is not None:
                raise click.ClickException(
                    f"{proc.name} exited with code {proc.popen.returncode} before it answered:\n{proc.log_tail()}"
                )
            try:
                r = client.get(proc.url + path)
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise click.ClickException(
                    f"{proc.name} did not answer GET {path} within {timeout:.0f}s ({last}):\n{proc.log_tail()}"
                )
            time.sleep(0.1)
