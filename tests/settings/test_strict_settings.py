"""Issue 26 (3): a typo at any level of the settings is an error naming the nearest valid
key; an unknown KVSTREAM_* variable is reported; ``kvstream config show`` says where
each setting came from and never shows a secret."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvstream.settings import SettingsError, load_settings, unknown_variables
from kvstream.tools.config_cmd import config


def test_a_typo_in_a_toml_section_is_an_error_with_the_nearest_key(tmp_path) -> None:
    path = tmp_path / "k.toml"
    path.write_text('[replica]\nsnapshot_dri = "/x"\n')
    with pytest.raises(SettingsError, match=r"unknown setting `replica.snapshot_dri` \(did you mean `replica.snapshot_dir`\?\)"):
        load_settings(path)


def test_a_typo_in_a_nested_variable_is_an_error(monkeypatch) -> None:
    monkeypatch.setenv("KVSTREAM_ROUTER__HOST_CACHE_HIT_WIEGHT", "0.5")
    with pytest.raises(SettingsError, match=r"`router.host_cache_hit_wieght` \(did you mean `router.host_cache_hit_weight`"):
        load_settings()


def test_an_unknown_top_level_variable_is_reported(monkeypatch) -> None:
    monkeypatch.setenv("KVSTREAM_BOOTSRAP", "h:1")
    monkeypatch.setenv("KVSTREAM_SCHEDULER__HOST_CACHE_HIT_WEIGHT", "0.5")  # the old docstring's name
    monkeypatch.setenv("KVSTREAM_TEST_KAFKA", "local")  # the tests' own: not a setting
    found = unknown_variables()
    assert "KVSTREAM_BOOTSRAP (did you mean KVSTREAM_BOOTSTRAP?)" in found
    assert any(v.startswith("KVSTREAM_SCHEDULER__HOST_CACHE_HIT_WEIGHT") for v in found)
    assert not any(v.startswith("KVSTREAM_TEST_KAFKA") for v in found)
    assert load_settings().bootstrap is None  # reported, and it set nothing


def test_a_secret_is_never_echoed(tmp_path) -> None:
    path = tmp_path / "k.toml"
    path.write_text('kafka_options = {"sasl.password" = 918273}\n[replica]\nport = 70000\n')
    with pytest.raises(SettingsError) as info:
        load_settings(path)
    text = str(info.value)
    assert "918273" not in text and "kafka_options.sasl.password" in text
    assert "`replica.port`: Input should be less than or equal to 65535 (got 70000)" in text


def test_config_show_says_where_each_setting_came_from(tmp_path, monkeypatch) -> None:
    path = tmp_path / "k.toml"
    path.write_text('[router]\npolicy = "ttft"\n[replica]\ntoken = "s3cret-value"\n')
    monkeypatch.setenv("KVSTREAM_REPLICA__PORT", "9011")
    out = CliRunner().invoke(config, ["show", "--config", str(path), "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)["settings"]
    assert doc["router.policy"] == {"value": "ttft", "source": "toml"}
    assert doc["replica.port"] == {"value": 9011, "source": "env"}
    assert doc["replica.host"] == {"value": "127.0.0.1", "source": "default"}
    assert doc["replica.token"]["value"] == "***" and "s3cret-value" not in out.output
    bad = tmp_path / "bad.toml"
    bad.write_text("[fold]\ncheck_kye = false\n")
    out = CliRunner().invoke(config, ["show", "--config", str(bad)])
    assert out.exit_code == 1 and "did you mean `fold.check_key`?" in out.output


@pytest.mark.parametrize(
    "text, hint",
    [
        ("[gateway]\nretires = 1\n", "unknown setting `gateway.retires` (did you mean `gateway.retries`?)"),
        ('[[gateway.workers]]\nid = 1\nurl = "http://h:1"\nmodelz = ["m"]\n',
         "unknown setting `gateway.workers.0.modelz` (did you mean `gateway.workers.0.models`?)"),
        ("[worker]\nlease_sm = 1\n", "unknown setting `worker.lease_sm` (did you mean `worker.lease_ms`?)"),
    ],
)
def test_a_typo_in_a_dataclass_section_names_the_nearest_key_too(tmp_path, text: str, hint: str) -> None:
    path = tmp_path / "k.toml"
    path.write_text(text)
    with pytest.raises(SettingsError) as info:
        load_settings(path)
    assert hint in str(info.value)
