"""The compiled core's own Rust unit tests (e.g. table.rs against std's HashMap),
run by cargo so that the suite covers them, not only whoever remembers to."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CRATE = Path(__file__).resolve().parents[2] / "kvstream" / "_native_src"
CACHE = Path(os.environ.get("KVSTREAM_CACHE") or Path.home() / ".cache" / "kvstream")

pytestmark = pytest.mark.slow


def test_cargo_unit_tests_pass() -> None:
    cargo = shutil.which("cargo")
    assert cargo is not None, "cargo is needed to build kvstream's Rust core; it is not on PATH"
    env = {**os.environ, "CARGO_TARGET_DIR": str(CACHE / "cargo-target-unit")}
    run = subprocess.run(
        [cargo, "test", "--release", "--lib", "--quiet"],
        cwd=CRATE, env=env, capture_output=True, text=True, timeout=540,
    )
    assert run.returncode == 0, f"cargo test failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    assert "test result: ok" in run.stdout, run.stdout[-2000:]
