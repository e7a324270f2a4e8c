"""``kvstream config show``: the effective settings, and where each one came from."""

from __future__ import annotations

import json

import click

from kvstream.settings import SettingsError, origins, unknown_variables


@click.group("config")
def config() -> None:
    """Inspect kvstream's settings (flags > KVSTREAM_* variables > TOML > defaults)."""


@config.command("show")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML settings file (else KVSTREAM_CONFIG).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: key → {value, source}.")
def show(config_file: str | None, as_json: bool) -> None:
    """Print every setting with its value and its source (flag, env, toml, default);
    secrets are masked. Unknown keys and variables are reported, not ignored."""
    try:
        effective = origins(config_file)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None
    unknown = unknown_variables()
    if as_json:
        doc = {k: {"value": v, "source": s} for k, (v, s) in effective.items()}
        click.echo(json.dumps({"settings": doc, "unknown_variables": unknown}, indent=2, default=str))
        return
    width = max(len(k) for k in effective)
    for key, (value, source) in effective.items():
        click.echo(f"{key:<{width}}  {json.dumps(value, default=str):<40}  {source}")
    for var in unknown:
        click.echo(f"warning: {var} sets nothing", err=True)
