"""matplotlib is the ``plot`` extra: without it everything but drawing works, and
``--plot`` fails with one line naming the extra."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Runs the kvstream command in a Python where matplotlib cannot be imported (as in an
#: install without the extra); ``sys.modules[name] = None`` makes its import fail.
_WITHOUT_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; "
    "from kvstream.cli import main; sys.argv[0] = 'kvstream'; main()"
)


def _kvstream(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", _WITHOUT_MATPLOTLIB, *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)


def test_simulate_runs_without_matplotlib_and_plot_names_the_extra(tmp_path: Path) -> None:
    common = ["simulate", "--sessions", "4", "--workers", "2", "--policy", "kv", "--json", "--no-progress"]
    ok = _kvstream(*common)
    assert ok.returncode == 0, ok.stderr
    assert '"policy"' in ok.stdout
    png = tmp_path / "p.png"
    res = _kvstream(*common, "--plot", str(png))
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert errors == ["Error: plots need matplotlib, which the 'plot' extra installs: pip install 'kvstream[plot]'"], res.stderr
    assert "Traceback" not in res.stderr
    assert not png.exists()
