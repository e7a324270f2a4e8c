"""The cached virtual environments the benchmarks install third-party tools into (the
peer routers, the trace replayer): made on first use, with a line saying so, and kept;
a version bump names a new one. One installer at a time (a lock beside them); a
half-made one (no ``.installed`` marker) is redone."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import click


def cached_venv(what: str, venv: Path, requirements: Sequence[str]) -> Path:
    """``venv`` with ``requirements`` installed (``what`` names them in messages)."""
    done = venv / ".installed"
    if done.is_file():
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.is_file():
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        click.echo(f"installing {what} ({', '.join(requirements)}) into {venv}...", err=True)
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", *requirements],
        ]
        for cmd in steps:
            try:
                subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
            except subprocess.CalledProcessError as exc:
                shutil.rmtree(venv, ignore_errors=True)
                raise click.ClickException(
                    f"cannot install {what} (`{' '.join(cmd)}`): {exc.stderr.strip()[-1000:]}"
                ) from None
            except (OSError, subprocess.SubprocessError) as exc:
                shutil.rmtree(venv, ignore_errors=True)
                raise click.ClickException(f"cannot install {what}: {exc}") from None
        done.write_text("\n".join(requirements) + "\n")
    return venv
