"""``kvstream broker start|stop`` say what a restart costs (issue 26): a fresh cluster,
its log wiped, on a new port."""

from __future__ import annotations

from click.testing import CliRunner

from kvstream.cli import cli


def test_stop_says_the_next_start_wipes_the_log_and_changes_the_port(tmp_path):
    result = CliRunner().invoke(cli, ["broker", "stop", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "wipes this cluster's log and serves on a new port" in result.output


def test_start_and_stop_help_say_a_start_is_a_fresh_cluster():
    for command in ("start", "stop"):
        result = CliRunner().invoke(cli, ["broker", command, "--help"])
        assert result.exit_code == 0
        text = " ".join(result.output.split())
        assert "the log of the previous one in this folder is wiped and the port is new" in text, text
