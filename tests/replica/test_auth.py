"""Tokens by scope (kvstream.replica.auth) and the loopback rule of ``kvstream router``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstream.replica.auth import Scope, TokenError, Tokens, read_token
from kvstream.replica.cli import is_loopback, tokens
from kvstream.settings import Settings

ALL = (Scope.CLIENT, Scope.OPERATOR, Scope.PEER)


def test_scopes_and_the_all_scope_token() -> None:
    t = Tokens.build("admin", client="c", operator="o", peer="p")
    assert t.allows("Bearer c", (Scope.CLIENT,)) and not t.allows("Bearer c", (Scope.OPERATOR, Scope.PEER))
    assert t.allows("Bearer o", (Scope.OPERATOR,)) and not t.allows("Bearer o", (Scope.CLIENT,))
    assert t.allows("Bearer p", (Scope.OPERATOR, Scope.PEER)) and not t.allows("Bearer p", (Scope.OPERATOR,))
    assert all(t.allows("Bearer admin", (s,)) for s in ALL)
    assert t.allows("bearer c", (Scope.CLIENT,))  # the scheme is case-insensitive
    for bad in ("", "Bearer", "Bearer ", "Basic c", "Bearer c ", "Bearer cc", "c"):
        assert not any(t.allows(bad, (s,)) for s in ALL), bad


def test_a_scope_without_a_token_is_closed_unless_none_is_set() -> None:
    t = Tokens.build(client="c")
    assert not t.open and not t.allows("Bearer c", (Scope.OPERATOR,)) and not t.allows("", (Scope.PEER,))
    assert Tokens.build().open and Tokens.build().allows("", ALL)


def test_tokens_from_files_and_their_errors(tmp_path: Path) -> None:
    f = tmp_path / "t"
    f.write_text("  s3cret\n")
    assert read_token(None, f, "token") == "s3cret"
    f.write_text("\n")
    with pytest.raises(TokenError, match="empty"):
        read_token(None, f, "token")
    with pytest.raises(TokenError, match="cannot read"):
        read_token(None, tmp_path / "missing", "token")
    with pytest.raises(TokenError, match="both"):
        read_token("x", f, "token")
    with pytest.raises(TokenError, match="empty"):
        read_token("  ", None, "token")
    (tmp_path / "c").write_text("from-file")
    s = Settings(replica={"client_token_file": tmp_path / "c", "operator_token": "o"})
    t = tokens(s)
    assert t.allows("Bearer from-file", (Scope.CLIENT,)) and t.allows("Bearer o", (Scope.OPERATOR,))


def test_loopback_hosts() -> None:
    for host in ("127.0.0.1", "127.3.2.1", "::1", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "example.com", ""):
        assert not is_loopback(host), host
