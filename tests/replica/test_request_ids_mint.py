"""Minted request ids: safe, unique in a process, and apart from a forked child's."""

from __future__ import annotations

import os

from kvstream.replica import request_ids


def test_minted_ids_are_safe_and_unique() -> None:
    ids = [request_ids.mint("gw-") for _ in range(10_000)] + [request_ids.mint() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(request_ids.is_safe(i) for i in ids)
    assert all(i.startswith("gw-") for i in ids[:10_000])


def test_a_forked_child_mints_other_ids() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first ids, to the parent
        os.write(write, " ".join(request_ids.mint() for _ in range(100)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        child = set(f.read().split())
    parent = {request_ids.mint() for _ in range(100)}
    assert len(child) == 100
    assert not child & parent
