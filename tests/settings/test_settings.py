"""One settings object: flags > KVSTREAM_* environment > TOML file > defaults."""

from __future__ import annotations

import pytest

from kvstream.replica.cli import replica_options, router_config
from kvstream.settings import SettingsError, load_settings

TOML = """
bootstrap = "from-file:9092"
kafka_options = { "security.protocol" = "SASL_SSL" }

[topics]
prefix = "file."
events_partitions = 6

[router]
host_cache_hit_weight = 0.5
ttft_rate_scope = "worker"

[replica]
port = 9000
snapshot_every_s = 5
"""


def test_layers_in_order(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "kvstream.toml"
    f.write_text(TOML)
    monkeypatch.setenv("KVSTREAM_TOPICS__EVENTS_PARTITIONS", "8")
    monkeypatch.setenv("KVSTREAM_ROUTER__DISK_CACHE_HIT_WEIGHT", "0.1")
    s = load_settings(f, bootstrap="from-flag:9092")
    assert s.bootstrap == "from-flag:9092"  # flag over file
    assert s.topics.prefix == "file."  # file over default
    assert s.topics.events_partitions == 8  # env over file
    assert s.kafka_options == {"security.protocol": "SASL_SSL"}
    cfg = router_config(s)
    assert cfg.scheduler.host_cache_hit_weight == 0.5
    assert cfg.scheduler.disk_cache_hit_weight == 0.1
    assert cfg.scheduler.overlap_score_credit == 1.0  # the reference default
    assert cfg.scheduler.ttft_rate_scope == "worker"
    opts = replica_options(s)
    assert opts.snapshot_every_s == 5
    assert s.replica.port == 9000


def test_config_file_from_environment(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "k.toml"
    f.write_text('bootstrap = "env-file:1"\n')
    monkeypatch.setenv("KVSTREAM_CONFIG", str(f))
    assert load_settings().bootstrap == "env-file:1"


@pytest.mark.parametrize(
    "text, match",
    [
        ("[router]\nhost_cache_hit_weight = -1\n", "host_cache_hit_weight"),
        ('[router]\nttft_rate_scope = "rack"\n', "ttft_rate_scope"),
        ("surprise = 1\n", "surprise"),
        ("[topics]\nevents_partitions = 0\n", "events_partitions"),
        ("bootstrap = \n", "not valid TOML"),
    ],
)
def test_bad_settings_are_clear_errors(tmp_path, text: str, match: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(SettingsError, match=match):
        load_settings(f)


def test_missing_config_file(tmp_path) -> None:
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")
