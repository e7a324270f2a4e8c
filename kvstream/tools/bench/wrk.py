"""A compiled load generator for ``kvstream bench http``: ``wrk`` (Debian's package),
installed by the benchmark's own setup when absent, driven with a Lua script that cycles
through the prompts' bodies and reports its summary as JSON (latency p50/p99 from wrk's
own histogram, requests, duration, errors)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import click

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


def ensure_wrk() -> str:
    """The path of ``wrk``, installing Debian's package when it is absent."""
    found = shutil.which("wrk")
    if found:
        return found
    click.echo("wrk not found: installing it (apt-get install -y wrk)...", err=True)
    try:
        subprocess.run(["apt-get", "install", "-y", "-q", "wrk"], check=True, capture_output=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        raise click.ClickException(f"wrk is needed and could not be installed with apt-get: {exc}") from None
    found = shutil.which("wrk")
    if not found:
        raise click.ClickException("apt-get installed wrk but it is not on PATH")
    return found


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
