"""A snapshot store's RocksDB as raw keys and values, as no replica reads it: to list every
key or damage one, for the tests of the store's checks. The store is closed meanwhile
(RocksDB lets one process hold a database once) and opened again after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rocksdict import Options, Rdict

from kvstream.replica.snapshot import SnapshotStore


@contextmanager
def raw_keys(store: SnapshotStore) -> Iterator[Rdict]:
    store.close()
    db = Rdict(str(store.path), Options(raw_mode=True))
    try:
        yield db
    finally:
        db.close()
        store.reopen()
