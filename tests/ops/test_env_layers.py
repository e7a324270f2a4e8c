"""Issue 26 (5): the dependencies are shared, but each checkout runs its own code. Two
clones set up with the README's set-up (ops/env.sh) over the same cached dependencies;
each one's .venv imports its own tree and runs its own `kvstream`, whichever was set
up last."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _set_up(clone: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    subprocess.run(["bash", "-c", "source ops/env.sh && kvstream_ensure_env"], cwd=clone, env=env, check=True,
                   capture_output=True, timeout=900)


def _imports(clone: Path) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    module = subprocess.run([str(clone / ".venv/bin/python"), "-c", "import kvstream; print(kvstream.__file__)"],
                            cwd="/", env=env, capture_output=True, text=True, check=True).stdout.strip()
    # The console script too, from anywhere: it must run this clone's code.
    marker = subprocess.run([str(clone / ".venv/bin/kvstream"), "checkout-marker"], cwd="/", env=env,
                            capture_output=True, text=True).stderr
    return module, marker


@pytest.mark.timeout(1800)
def test_two_clones_each_run_their_own_code(tmp_path: Path) -> None:
    clones = [tmp_path / "a", tmp_path / "b"]
    for clone in clones:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
        # Each clone's own code says which clone it is: a command only it has.
        (clone / "kvstream" / "cli.py").write_text(
            (clone / "kvstream" / "cli.py").read_text().replace(
                '    "hash": (',
                f'    "checkout-marker": ("no.such.module{clone.name}:x", "marker"),\n    "hash": (',
            )
        )
    for clone in clones:
        _set_up(clone)
    for clone in clones:  # a set up last must not take b's place, nor b a's
        module, marker = _imports(clone)
        assert module == str(clone / "kvstream" / "__init__.py")
        assert f"no.such.module{clone.name}" in marker or "'no'" in marker, marker
        assert (clone / ".venv").is_dir() and not (clone / ".venv").is_symlink()
