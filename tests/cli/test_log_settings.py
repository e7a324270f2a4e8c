"""Issue 24: the settings ``log_level`` and ``log_format`` are read: ``kvstream router``
logs as its TOML file says, and ``kvstream --log-level`` / ``--log-format`` and
``KVSTREAM_LOG_LEVEL`` / ``KVSTREAM_LOG_FORMAT`` still win over the file."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvstream.settings import Settings, SettingsError, load_settings
from kvstream.tools.procs import free_port

from tests.faults.helpers import KVSTREAM, ROOT, router_env, stop_process, wait_http

TOML = 'log_level = "warning"\nlog_format = "json"\n'


def _router_log(settings: Settings, tmp_path: Path, name: str, group_flags: list[str], env: dict[str, str]) -> list[str]:
    """The log lines of a router that became ready and was stopped."""
    config = tmp_path / "kvstream.toml"
    config.write_text(TOML)
    port = free_port()
    full_env = {k: v for k, v in router_env(settings).items() if not k.startswith("KVSTREAM_LOG_")} | env
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(KVSTREAM), *group_flags, "router", "--config", str(config), "--bootstrap", str(settings.bootstrap),
             "--port", str(port)],
            env=full_env, stdout=subprocess.DEVNULL, stderr=out, stdin=subprocess.DEVNULL, cwd=ROOT,
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", 60, proc)
    finally:
        stop_process(proc)
    assert proc.returncode == 0, log.read_text()
    return [line for line in log.read_text().splitlines() if line.strip()]


def _events(lines: list[str]) -> list[dict]:
    """Every line as a JSON log record (a line that is not one fails the test)."""
    return [json.loads(line) for line in lines]


@pytest.mark.kafka
def test_router_logs_as_its_toml_says_and_flags_and_variables_win(kafka_topics: Settings, tmp_path: Path) -> None:
    # The file alone: warnings only (no "serving", no "ready"), as JSON.
    quiet = _events(_router_log(kafka_topics, tmp_path, "toml", [], {}))
    assert not [e for e in quiet if e["level"] == "info"], quiet

    # The flag's level over the file's; the file's format still holds.
    loud = _events(_router_log(kafka_topics, tmp_path, "flag", ["--log-level", "INFO"], {}))
    assert {"serving", "ready"} <= {e["event"] for e in loud if e["level"] == "info"}

    # The variables over the file: info lines, for people (not JSON).
    console = _router_log(kafka_topics, tmp_path, "env", [], {"KVSTREAM_LOG_LEVEL": "info", "KVSTREAM_LOG_FORMAT": "console"})
    ready = [line for line in console if " ready " in f" {line} "]
    assert ready and not ready[0].startswith("{"), console


def test_log_settings_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text('log_level = "debug"\n')
    assert load_settings(path).log_level == "DEBUG"  # any case, as the flag takes it
    for text, key in (('log_level = "loud"\n', "log_level"), ('log_format = "xml"\n', "log_format")):
        path.write_text(text)
        with pytest.raises(SettingsError, match=f"`{key}`"):
            load_settings(path)
