"""Issue 26 (4): a mistake gets one line with the reason and the fix, not a traceback, a
pydantic dump or hundreds of librdkafka lines. Each case runs the real command."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KVSTREAM = [sys.executable, "-m", "kvstream.cli"]

SASL = 'bootstrap = "127.0.0.1:1"\nkafka_options = { "security.protocol" = "SASL_SSL", "sasl.mechanism" = "PLAIN" }\n'


def run(args: list[str], tmp_path: Path, timeout: float = 60) -> tuple[int, list[str], float]:
    t0 = time.monotonic()
    out = subprocess.run([*KVSTREAM, *args], capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)})
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    return out.returncode, lines, time.monotonic() - t0


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["router", "--bootstrap", "127.0.0.1:1", "--port", "70000"], "`replica.port`: Input should be less than or equal to 65535 (got 70000)"),
        (["router", "--bootstrap", "127.0.0.1:1", "--token", ""], "`replica.token`: String should have at least 1 character"),
        (["router", "--config", "sasl.toml"], "sasl.username and sasl.password must be set"),
        (["topics", "create", "--config", "sasl.toml"], "sasl.username and sasl.password must be set"),
        (["worker", "--engine", "synthetic", "--worker-id", "1", "--config", "sasl.toml"], "sasl.username and sasl.password must be set"),
        (["topics", "create", "--config", "unknown-key.toml"], 'No such configuration property: "foo.bar"'),
        (["router", "--config", "typo.toml"], "unknown setting `replica.snapshot_dri` (did you mean `replica.snapshot_dir`?)"),
    ],
)
def test_one_line(args: list[str], expect: str, tmp_path: Path) -> None:
    (tmp_path / "sasl.toml").write_text(SASL)
    (tmp_path / "unknown-key.toml").write_text('bootstrap = "127.0.0.1:1"\nkafka_options = { "foo.bar" = "1" }\n')
    (tmp_path / "typo.toml").write_text('bootstrap = "127.0.0.1:1"\n[replica]\nsnapshot_dri = "/x"\n')
    rc, lines, _ = run(args, tmp_path)
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("Error: ") and expect in lines[0], lines


def test_an_unreachable_broker_is_one_line_and_quick(tmp_path: Path) -> None:
    rc, lines, took = run(["router", "--bootstrap", "127.0.0.1:1"], tmp_path)
    assert rc == 1, lines
    errors = [line for line in lines if line.startswith("Error: ")]
    assert len(errors) == 1 and "cannot reach Kafka at 127.0.0.1:1 within 10 s" in errors[0], lines
    # librdkafka's repeated connection failures are folded, not printed hundreds of times.
    assert len(lines) <= 3, lines
    assert took < 25, f"{took:.1f}s"
