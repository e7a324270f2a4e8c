"""Request ids: what a client may use, and how a replica keeps them apart from its peers'.

A client's id is restricted to a safe set (letters, digits, ``.``, ``_``, ``:``, ``-``; at
most 128 characters), so it can always be named in a URL path again to free it. Inside a
replica, and in every replica that applies its ops from ``kvstream.active``, an id is
scoped by the replica that accepted it (``<replica_id>/<request_id>``): two replicas that
accept the same client id track two requests, and one client's ``DELETE`` can never free
the other's. On the wire (``kvstream.active``) the id travels unscoped next to the
replica id, and the receiver scopes it.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets

MAX_LENGTH = 128
#: The safe set, as a regular expression (also the OpenAPI ``pattern``).
PATTERN = rf"^[A-Za-z0-9._:-]{{1,{MAX_LENGTH}}}$"
_SAFE = re.compile(PATTERN)
_SEP = "/"


def is_safe(request_id: str) -> bool:
    return _SAFE.fullmatch(request_id) is not None


def scoped(replica_id: str, request_id: str) -> str:
    """The id under which ``replica_id``'s request ``request_id`` is tracked."""
    return f"{replica_id}{_SEP}{request_id}"


def unscoped(key: str) -> str:
    """The client's id of a scoped one (client ids never contain the separator)."""
    return key.rpartition(_SEP)[2]


class _Minter:
    """Ids unique to this process (a random prefix, then a count): as unique as random
    ones among replicas and their restarts, without a system call per request (the
    gateway mints two per request; ``secrets`` read the OS's random source each time)."""

    def __init__(self) -> None:
        self.reseed()

    def reseed(self) -> None:
        self.prefix, self.count = secrets.token_hex(8), itertools.count()

    def __call__(self, tag: str = "") -> str:
        return f"{tag}{self.prefix}{next(self.count):x}"


#: ``mint(tag)``: a new id, ``tag`` first (safe: hex digits after it).
mint = _Minter()
os.register_at_fork(after_in_child=mint.reseed)
