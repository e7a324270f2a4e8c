"""Frozen option dataclasses are where kvstream's settings are defined: each field's name,
type (with its bounds, as ``Annotated[int, Field(ge=1)]``), default and doc comment.
kvstream.settings derives its sections from them; a field that is set by code, not by
users (a tunable of the tests, a value computed from other settings), is marked
:func:`internal` and is no key of any section."""

from __future__ import annotations

from dataclasses import MISSING, Field, field
from typing import Any

#: The metadata key that marks an internal field.
INTERNAL = "kvstream.internal"


def internal(default: Any = MISSING, *, default_factory: Any = MISSING) -> Any:
    """A dataclass field that is no setting: code passes it, or its default holds."""
    return field(default=default, default_factory=default_factory, metadata={INTERNAL: True})


def is_internal(f: Field) -> bool:
    return bool(f.metadata.get(INTERNAL))
