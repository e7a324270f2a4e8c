"""Bearer tokens of the replica's HTTP API, by scope.

- ``client``: routing (``POST /v1/route``, ``prefill_done``, ``DELETE`` of a request);
- ``operator``: ``GET /v1/workers``, ``GET /v1/snapshot``, and ``/docs`` when enabled;
- ``peer``: ``GET /v1/snapshot`` (another replica bootstrapping).

``/healthz``, ``/readyz`` and ``/metrics`` need none. A token comes from the settings
(``KVSTREAM_REPLICA__CLIENT_TOKEN`` and friends, or TOML) or from a file
(``client_token_file``; what a secret mount provides), never only from a flag that
``/proc/PID/cmdline`` shows. ``token`` is accepted for every scope (one token for a
small deployment). With no token at all the API is open, which the replica allows only
on a loopback address (kvstream.replica.cli). An empty token is an error, never a
token that ``Authorization: Bearer `` matches.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kvstream.replica.errors import ReplicaError


class Scope(StrEnum):
    CLIENT = "client"
    OPERATOR = "operator"
    PEER = "peer"


class TokenError(ReplicaError):
    """A token that cannot be used (an empty value, an unreadable or empty file)."""


def read_token(value: str | None, file: Path | None, name: str) -> str | None:
    """The token given as ``value`` or in ``file`` (its whitespace-stripped content)."""
    if value is not None and file is not None:
        raise TokenError(f"{name} is given both as a value and as a file: give one")
    if file is not None:
        try:
            value = file.read_text().strip()
        except OSError as exc:
            raise TokenError(f"cannot read {name} file {file}: {exc.strerror}") from None
        if not value:
            raise TokenError(f"{name} file {file} is empty")
    if value is not None and not value.strip():
        raise TokenError(f"{name} is empty")
    return value


@dataclass(frozen=True, slots=True)
class Tokens:
    """The accepted tokens of each scope."""

    by_scope: dict[Scope, tuple[bytes, ...]]

    @classmethod
    def build(
        cls,
        any_scope: str | None = None,
        client: str | None = None,
        operator: str | None = None,
        peer: str | None = None,
    ) -> Tokens:
        given = {Scope.CLIENT: client, Scope.OPERATOR: operator, Scope.PEER: peer}
        by_scope = {
            s: tuple(t.encode() for t in (tok, any_scope) if t is not None) for s, tok in given.items()
        }
        return cls(by_scope)

    @property
    def open(self) -> bool:
        """No token at all: every endpoint answers anyone."""
        return not any(self.by_scope.values())

    def allows(self, authorization: str, scopes: tuple[Scope, ...]) -> bool:
        """Whether an ``Authorization`` header value carries a token of one of ``scopes``."""
        if self.open:
            return True
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not given:
            return False
        raw = given.encode()
        ok = False
        for scope in scopes:
            for token in self.by_scope[scope]:
                ok |= hmac.compare_digest(raw, token)  # no early exit: constant time per try
        return ok
