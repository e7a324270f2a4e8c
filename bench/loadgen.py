"""Compiled load generators for ``kvstream bench http``, installed by the benchmark's own
setup when absent:

- ``wrk`` (Debian's package; closed loop: each connection sends its next request when the
  last is answered, for the most requests/s), driven with a Lua script that cycles through
  the prompts' bodies and reports its summary as JSON (latency p50/p99 from wrk's own
  histogram, requests, duration, errors);
- ``oha`` (crates.io, built with ``cargo install``; open loop: requests start at a fixed
  rate whether or not earlier ones were answered, and each latency counts from when its
  request was due, so a stalled server cannot hide its queue: the p99 at a given rate).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

#: The oha release whose JSON report this module reads.
OHA_VERSION = "1.16.0"

# Bodies: one file, fixed-size records (every prompt of the bench has the same length
# for binary bodies; JSON bodies are padded with spaces, which JSON ignores).
_SCRIPT = """
local f = assert(io.open(%(path)s, "rb"))
local data = f:read("*a")
f:close()
local size = %(size)d
local count = math.floor(#data / size)
local i = 0
local bad = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = %(ctype)s
function request()
  local k = i %% count
  i = i + 1
  return wrk.format(nil, %(path_q)s, nil, data:sub(k * size + 1, (k + 1) * size))
end
function response(status, headers, body)
  if status ~= 200 then bad = bad + 1 end
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\nKVSTREAM {"requests": %%d, "duration_us": %%d, "p50_us": %%d, "p99_us": %%d, ' ..
    '"connect": %%d, "read": %%d, "write": %%d, "status": %%d, "timeout": %%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


def ensure_tool(name: str, install: Sequence[str], where: Sequence[Path] = (), note: str = "") -> str:
    """The path of the program ``name`` (on PATH or in ``where``), running ``install``
    first when it is absent (``note``: what to expect of it)."""

    def find() -> str | None:
        found = shutil.which(name)
        return found or next((str(d / name) for d in where if os.access(d / name, os.X_OK)), None)

    found = find()
    if found:
        return found
    command = " ".join(install)
    click.echo(f"{name} not found: installing it ({command}{note})...", err=True)
    try:
        subprocess.run(install, check=True, capture_output=True, timeout=1800)
    except subprocess.CalledProcessError as exc:
        tail = exc.stderr.decode(errors="replace").strip()[-500:]
        raise click.ClickException(f"{name} is needed and `{command}` failed: {tail}") from None
    except (OSError, subprocess.SubprocessError) as exc:
        raise click.ClickException(f"{name} is needed and `{command}` could not run: {exc}") from None
    found = find()
    if not found:
        raise click.ClickException(f"`{command}` succeeded but {name} is not on PATH")
    return found


def ensure_wrk() -> str:
    return ensure_tool("wrk", ["apt-get", "install", "-y", "-q", "wrk"])


def ensure_oha() -> str:
    cargo_bin = Path(os.environ.get("CARGO_HOME", Path.home() / ".cargo")) / "bin"
    cargo = shutil.which("cargo") or str(cargo_bin / "cargo")
    # Plain HTTP only here, but oha does not build without one of its TLS features.
    return ensure_tool(
        "oha", [cargo, "install", "--locked", "oha", "--version", OHA_VERSION], [cargo_bin],
        "; it compiles from source, about 10 minutes, once",
    )


def run_wrk(
    url: str, path: str, bodies: list[bytes], content_type: str, connections: int, threads: int, duration_s: float
) -> dict[str, Any]:
    """Closed-loop load: ``connections`` keep-alive connections for ``duration_s``."""
    wrk = ensure_wrk()
    size = max(len(b) for b in bodies)
    pad = b" " if content_type == "application/json" else None
    if pad is None and any(len(b) != size for b in bodies):
        raise click.ClickException("binary bodies must all have the same length")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "bodies"
        data.write_bytes(b"".join(b.ljust(size, pad or b"\0") for b in bodies))
        script = Path(tmp) / "bodies.lua"
        script.write_text(_SCRIPT % {
            # JSON string literals are Lua string literals (ASCII paths and types).
            "path": json.dumps(str(data)), "size": size, "ctype": json.dumps(content_type), "path_q": json.dumps(path),
        })
        cmd = [wrk, "-t", str(threads), "-c", str(connections), "-d", f"{duration_s:g}s", "-s", str(script), url]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 120)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("KVSTREAM ")), None)
    if out.returncode != 0 or line is None:
        raise click.ClickException(f"wrk failed (exit {out.returncode}): {out.stderr.strip() or out.stdout[-500:]}")
    r = json.loads(line.removeprefix("KVSTREAM "))
    errors = r["connect"] + r["read"] + r["write"] + r["status"] + r["timeout"]
    if errors:
        raise click.ClickException(f"wrk saw {errors} failed requests: {r}")
    return {
        "requests": r["requests"],
        "requests_per_s": round(r["requests"] / (r["duration_us"] / 1e6)),
        "p50_us": r["p50_us"],
        "p99_us": r["p99_us"],
    }


def run_oha(
    url: str, path: str, bodies: list[bytes], content_type: str, rate: float | None, connections: int,
    duration_s: float,
) -> dict[str, Any]:
    """Open-loop load: requests due at ``rate`` per second for ``duration_s`` over up to
    ``connections`` keep-alive connections, latency counted from each request's due time
    (oha's ``--latency-correction``); ``rate`` None: closed loop (each connection sends
    its next request when the last is answered). Several bodies need one line each
    (JSON); a single body is sent as it is (binary)."""
    oha = ensure_oha()
    if len(bodies) > 1 and any(b"\n" in b for b in bodies):
        raise click.ClickException("several bodies for oha must each fit on one line")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "bodies"
        if len(bodies) > 1:
            data.write_bytes(b"\n".join(bodies) + b"\n")
            body = ["-Z", str(data)]
        else:
            data.write_bytes(bodies[0])
            body = ["-D", str(data)]
        cmd = [
            oha, "--no-tui", "--output-format", "json", "-z", f"{duration_s:g}s",
            *([] if rate is None else ["-q", f"{rate:g}", "--latency-correction"]),
            "-c", str(connections), "-m", "POST", "-T", content_type, *body, url + path,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 120)
    if out.returncode != 0:
        raise click.ClickException(f"oha failed (exit {out.returncode}): {out.stderr.strip()[-500:]}")
    try:
        r = json.loads(out.stdout)
        statuses = {int(k): v for k, v in r["statusCodeDistribution"].items()}
        # Requests still running at the deadline are aborted, not failed.
        errors = {k: v for k, v in r["errorDistribution"].items() if "deadline" not in k}
        p50, p99 = r["latencyPercentiles"]["p50"], r["latencyPercentiles"]["p99"]
        rps = r["summary"]["requestsPerSec"]
    except (ValueError, KeyError, TypeError) as exc:
        raise click.ClickException(f"unexpected oha report (oha {OHA_VERSION} is expected): {exc!r}") from None
    if errors or set(statuses) - {200}:
        raise click.ClickException(f"oha saw failed requests: statuses {statuses}, errors {errors}")
    return {
        "requests": sum(statuses.values()),
        "requests_per_s": round(rps),
        "p50_us": round(p50 * 1e6),
        "p99_us": round(p99 * 1e6),
    }
