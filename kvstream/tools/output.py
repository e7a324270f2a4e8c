"""How kvstream's tools print a result: one JSON object (``--json``), or aligned lines."""

from __future__ import annotations

import json
import platform
from typing import Any

import click


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print the result: one JSON object, or aligned ``key  value`` lines."""
    result = {"machine": platform.machine(), "python": platform.python_version(), **result}
    if as_json:
        click.echo(json.dumps(result))
        return
    width = max(len(k) for k in result)
    for k, v in result.items():
        click.echo(f"{k:<{width}}  {v}")
