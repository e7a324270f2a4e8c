"""Issue 24: each setting is defined once, by a field of a frozen option dataclass; the
settings sections are derived from them (kvstream.settings.section) and convert back
(``Section.to_options``), so that no key can exist on one side only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest

from kvstream.options import internal, is_internal
from kvstream.replica.cli import PER_REQUEST_ONLY, http_limits, replica_options, router_config
from kvstream.replica.options import HttpLimits, ReplicaOptions, ServerOptions
from kvstream.router import RouterConfig, SchedulerConfig
from kvstream.settings import ReplicaSettings, RouterSettings, SettingsError, WorkerSettings, load_settings, section

REPLICA = (ServerOptions, HttpLimits, ReplicaOptions)


def _other(f: dataclasses.Field) -> Any:
    """A TOML value for the field that is not its default (and within its bounds)."""
    default = None if f.default is dataclasses.MISSING else f.default
    kind = str(f.type)
    if kind == "bool":
        return not default
    if "int" in kind:
        return default + 1
    if "float" in kind:
        return default + 0.5
    return f"/tmp/{f.name}" if "Path" in kind else f"value-of-{f.name}"


def test_the_replica_section_is_the_fields_of_its_option_dataclasses() -> None:
    settings_fields = [f for cls in REPLICA for f in fields(cls) if not is_internal(f)]
    assert list(ReplicaSettings.model_fields) == [f.name for f in settings_fields]
    for f in settings_fields:
        if f.default is not dataclasses.MISSING:
            assert ReplicaSettings.model_fields[f.name].default == f.default, f.name
    # Internal fields (set by code) are no keys: a TOML file naming one is told so.
    internal_names = {f.name for cls in REPLICA for f in fields(cls) if is_internal(f)}
    assert internal_names and not internal_names & {"peer_url", "replica_id"}


def test_every_replica_key_reaches_its_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = {f.name: _other(f) for cls in REPLICA for f in fields(cls) if not is_internal(f)}
    lines = "\n".join(f"{k} = {v!r}".replace("True", "true").replace("False", "false").replace("'", '"')
                      for k, v in values.items())
    path = tmp_path / "k.toml"
    path.write_text(f"[replica]\n{lines}\n")
    monkeypatch.setenv("KVSTREAM_REPLICA__ROUTE_THREADS", "11")  # env over the file
    s = load_settings(path)
    got = {}
    for cls in REPLICA:
        got |= {k: getattr(s.replica.to_options(cls), k) for k in ReplicaSettings.option_keys[cls]}
    expected = values | {"route_threads": 11}
    assert {k: str(v) if isinstance(v, Path) else v for k, v in got.items()} == expected
    assert http_limits(s).route_threads == 11


def test_an_internal_field_is_no_setting(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text("[replica]\nconsume_batch = 5\n")
    with pytest.raises(SettingsError, match=r"unknown setting `replica.consume_batch`"):
        load_settings(path)


def test_the_peer_token_presented_is_the_peer_scope_s_else_the_shared_one(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text('[replica]\ntoken = "shared"\n')
    assert replica_options(load_settings(path)).peer_token == "shared"
    path.write_text('[replica]\ntoken = "shared"\npeer_token = "peers"\n')
    options = replica_options(load_settings(path))
    assert options.peer_token == "peers" and "peers" not in repr(options)
    section = load_settings(path).replica
    assert "shared" not in repr(section) and "shared" not in repr(section.to_options(ServerOptions))


def test_a_key_defined_twice_or_a_setting_passed_by_code_is_refused() -> None:
    @dataclass(frozen=True)
    class A:
        x: int = 1
        secret: str | None = internal(None)

    @dataclass(frozen=True)
    class B:
        x: int = 2

    with pytest.raises(TypeError, match="`x` is defined by two"):
        section("Twice", "doc", A, B)
    derived = section("Once", "doc", A)
    assert list(derived.model_fields) == ["x"]
    assert derived(x=3).to_options(A, secret="s") == A(3, "s")
    with pytest.raises(TypeError, match="are settings"):
        derived().to_options(A, x=4)
    with pytest.raises(TypeError, match="not derived from"):
        derived().to_options(B)


def test_every_router_key_is_a_field_of_the_router_s_config() -> None:
    """[router] is still written out in kvstream.settings (its scheduler weights are
    being reworked with the compiled core); this pins it to SchedulerConfig until it
    is derived too: router_config fails on a missing key, this on an extra one."""
    scheduler = {f.name for f in fields(SchedulerConfig)} - PER_REQUEST_ONLY
    router = {f.name for f in fields(RouterConfig)} - {"scheduler"}
    # require_registration is the admission rule's (kvstream.replica.admission).
    assert set(RouterSettings.model_fields) == scheduler | router | {"require_registration"}
    assert router_config(load_settings()).scheduler == SchedulerConfig()


def test_the_worker_section_is_worker_options_and_its_parts_default_to_it(tmp_path: Path) -> None:
    from kvstream.worker.engine_node import EngineNodeOptions
    from kvstream.worker.options import DEFAULTS, Mode, QueueFull, WorkerOptions
    from kvstream.worker.publisher import PublisherOptions
    from kvstream.worker.zmq_bridge import BridgeOptions, Endpoint

    assert list(WorkerSettings.model_fields) == [f.name for f in fields(WorkerOptions)]
    publisher = PublisherOptions(worker_id=1)
    assert (publisher.lease_ms, publisher.heartbeat_s, publisher.linger_ms, publisher.queue_full) == (
        DEFAULTS.lease_ms, DEFAULTS.heartbeat_s, DEFAULTS.linger_ms, DEFAULTS.queue_full)
    bridge = BridgeOptions(endpoints=(Endpoint("tcp://127.0.0.1:1", None, 0),))
    node = EngineNodeOptions(publisher, bridge)
    assert (node.mode, node.state_dir, node.checkpoint_s, bridge.offload_blocks_per_chunk) == (
        DEFAULTS.mode, DEFAULTS.state_dir, DEFAULTS.checkpoint_s, DEFAULTS.offload_blocks_per_chunk)
    path = tmp_path / "k.toml"
    path.write_text('[worker]\nmode = "passthrough"\nqueue_full = "fail"\nstate_dir = "/tmp/w"\n')
    got = load_settings(path).worker.to_options(WorkerOptions)
    assert (got.mode, got.queue_full, got.state_dir) == (Mode.PASSTHROUGH, QueueFull.FAIL, Path("/tmp/w"))
    path.write_text('[worker]\nmode = "merge"\n')
    with pytest.raises(SettingsError, match=r"`worker.mode`: Input should be 'dedup' or 'passthrough'"):
        load_settings(path)


def test_a_worker_flag_is_held_to_its_setting_s_bounds() -> None:
    from click.testing import CliRunner

    from kvstream.worker.cli import worker

    out = CliRunner().invoke(worker, ["--engine", "zmq", "--endpoint", "tcp://127.0.0.1:1", "--worker-id", "1",
                                      "--lease-ms", "0", "--checkpoint-s", "0"])
    assert out.exit_code == 1, out.output
    assert "`worker.lease_ms`: Input should be greater than or equal to 1 (got 0)" in out.output
    assert "`worker.checkpoint_s`: Input should be greater than 0 (got 0.0)" in out.output
