"""Bootstrapping a new replica from a peer's snapshot (``GET /v1/snapshot``).

The stream is the newest generation whose meta verifies: the meta (with its checksum),
then each worker's stored blob, every frame length-prefixed. Both sides hold at most one
64 KiB chunk at a time (the sender reads blobs chunk by chunk, the receiver writes them
so), whatever the snapshot's size. The receiver accepts exactly what the meta announces
(each worker once, with the announced length, a meta of bounded size, a total no larger
than its cap), verifies every checksum and stamp, and commits the generation into its own
store only when all of it arrived intact.
"""

from __future__ import annotations

import ssl
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx

from kvstream.replica.errors import SnapshotError
from kvstream.replica.snapshot import STAMP_BYTES, SnapshotMeta, SnapshotStore, WorkerMeta

_FRAME = struct.Struct(">QQ")  # worker id (or 0 for the meta), payload length
#: Largest meta frame accepted (JSON of every worker's record).
MAX_META_BYTES = 256 * 1024 * 1024
#: Default cap on a whole peer snapshot (the sum of its blobs).
MAX_SNAPSHOT_BYTES = 16 * 1024**3


def stream_snapshot(store: SnapshotStore) -> Iterator[bytes]:
    """The newest valid generation as frames, read chunk by chunk. A blob that fails its
    checksum ends the stream with an error (the receiver refuses a short stream)."""
    meta, skipped = store.latest_meta()
    if meta is None:
        raise SnapshotError("no valid snapshot to serve" + (f" ({'; '.join(skipped)})" if skipped else ""))
    raw_meta = meta.to_bytes()
    yield _FRAME.pack(0, len(raw_meta)) + raw_meta
    for wid, wm in meta.workers():
        yield _FRAME.pack(wid, wm.blob.nbytes)
        yield from store.blob_chunks(wid, wm.blob)


class _Reader:
    """Exact reads over an iterator of byte chunks, holding at most one chunk."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = memoryview(b"")

    def _fill(self) -> bool:
        for chunk in self._chunks:
            if chunk:
                self._buf = memoryview(chunk)
                return True
        return False

    def pieces(self, n: int) -> Iterator[bytes]:
        """Exactly ``n`` bytes, in pieces; SnapshotError if the stream ends first."""
        while n:
            if not self._buf and not self._fill():
                raise SnapshotError("peer snapshot stream is truncated")
            take = self._buf[:n]
            self._buf = self._buf[len(take):]
            n -= len(take)
            yield bytes(take)

    def exact(self, n: int) -> bytes:
        return b"".join(self.pieces(n))

    def at_end(self) -> bool:
        return not self._buf and not self._fill()


def receive_snapshot(chunks: Iterator[bytes], store: SnapshotStore, max_bytes: int = MAX_SNAPSHOT_BYTES) -> int:
    """Write a peer snapshot stream into ``store`` and commit it; returns its generation.
    SnapshotError (nothing committed) for anything but exactly what the meta announces."""
    reader = _Reader(chunks)
    wid, n = _FRAME.unpack(reader.exact(_FRAME.size))
    if wid != 0 or n > MAX_META_BYTES:
        raise SnapshotError(f"peer snapshot does not start with a meta of at most {MAX_META_BYTES} bytes")
    meta = SnapshotMeta.from_bytes(reader.exact(n))
    todo = dict(meta.workers())
    total = sum(wm.blob.nbytes for wm in todo.values())
    if total > max_bytes:
        raise SnapshotError(f"peer snapshot announces {total} bytes, more than the cap of {max_bytes}")
    written: list[int] = []
    try:
        _receive_blobs(reader, store, meta, todo, written)
    except SnapshotError:
        for wid in written:  # nothing of a refused stream stays behind
            store.discard_blob(wid, meta.gen)
        raise
    store.commit(meta, 0)
    return meta.gen


def _receive_blobs(
    reader: _Reader, store: SnapshotStore, meta: SnapshotMeta, todo: dict[int, WorkerMeta], written: list[int]
) -> None:
    while todo:
        wid, n = _FRAME.unpack(reader.exact(_FRAME.size))
        wm = todo.pop(wid, None)
        if wm is None:
            raise SnapshotError(f"peer snapshot sends worker {wid}, which its meta does not list (or twice)")
        if n != wm.blob.nbytes:
            raise SnapshotError(f"peer snapshot: worker {wid}'s blob is {n} bytes, its meta says {wm.blob.nbytes}")
        writer = store.blob_writer(wid, meta.gen)
        written.append(wid)
        head = b""
        for piece in reader.pieces(n):
            if len(head) < STAMP_BYTES:
                head += piece[: STAMP_BYTES - len(head)]
            writer.write(piece)
        ref = writer.finish()
        if ref.checksum != wm.blob.checksum:
            raise SnapshotError(f"peer snapshot: worker {wid} fails its checksum")
        if head != wm.stamp(wid):
            raise SnapshotError(f"peer snapshot: worker {wid}'s blob was captured at another position than its meta says")
        wm.blob = ref
    if not reader.at_end():
        raise SnapshotError("peer snapshot has bytes after its last worker")


def fetch_peer_snapshot(
    base_url: str,
    store: SnapshotStore,
    token: str | None = None,
    timeout: float = 120.0,
    max_bytes: int = MAX_SNAPSHOT_BYTES,
    ca_file: Path | None = None,
) -> int:
    """Copy the peer's newest snapshot into ``store``; returns its generation. ``token``
    is a bearer token with the peer scope on the peer; ``ca_file`` verifies an https
    peer signed by a private CA."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    verify: bool | ssl.SSLContext = ssl.create_default_context(cafile=str(ca_file)) if ca_file else True
    url = base_url.rstrip("/") + "/v1/snapshot"
    try:
        with httpx.stream("GET", url, headers=headers, timeout=timeout, verify=verify) as resp:
            if resp.status_code != 200:
                raise SnapshotError(f"peer answered {resp.status_code}")
            return receive_snapshot(resp.iter_raw(), store, max_bytes)
    except httpx.HTTPError as exc:
        raise SnapshotError(f"peer snapshot transfer failed: {exc}") from None
