"""Bootstrapping a new replica from a peer's snapshot (``GET /v1/snapshot``).

The stream is the newest valid generation: the meta (with its checksum) then each
worker's blob, every frame length-prefixed. The receiver verifies every checksum and
commits the generation into its own store only when all of it arrived intact.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import httpx

from kvstream.replica.errors import SnapshotError
from kvstream.replica.snapshot import SnapshotMeta, SnapshotStore

_FRAME = struct.Struct(">QQ")  # worker id (or 0 for the meta), payload length


def stream_snapshot(store: SnapshotStore) -> Iterator[bytes]:
    loaded, skipped = store.load_latest()
    if loaded is None:
        raise SnapshotError("no valid snapshot to serve" + (f" ({'; '.join(skipped)})" if skipped else ""))
    meta, _ = loaded
    raw_meta = meta.to_bytes()
    yield _FRAME.pack(0, len(raw_meta)) + raw_meta
    for pm in meta.partitions.values():
        for wid, wm in pm.workers.items():
            blob = store.read_blob(wid, wm.blob)
            yield _FRAME.pack(wid, len(blob)) + blob


def fetch_peer_snapshot(
    base_url: str, store: SnapshotStore, token: str | None = None, timeout: float = 120.0
) -> int:
    """Copy the peer's newest snapshot into ``store``; returns its generation. ``token``
    is the peer's bearer token (replicas of one deployment share it)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.stream("GET", base_url.rstrip("/") + "/v1/snapshot", headers=headers, timeout=timeout) as resp:
        if resp.status_code != 200:
            raise SnapshotError(f"peer answered {resp.status_code}")
        buf = bytearray()
        frames: list[tuple[int, bytes]] = []
        for chunk in resp.iter_bytes():
            buf += chunk
            while len(buf) >= _FRAME.size:
                wid, n = _FRAME.unpack_from(buf)
                if len(buf) < _FRAME.size + n:
                    break
                frames.append((wid, bytes(buf[_FRAME.size : _FRAME.size + n])))
                del buf[: _FRAME.size + n]
    if buf or not frames or frames[0][0] != 0:
        raise SnapshotError("peer snapshot stream is truncated or malformed")
    meta = SnapshotMeta.from_bytes(frames[0][1])
    blobs = dict(frames[1:])
    for pm in meta.partitions.values():
        for wid, wm in pm.workers.items():
            blob = blobs.get(wid)
            if blob is None:
                raise SnapshotError(f"peer snapshot lacks worker {wid}")
            ref = store.write_blob(wid, meta.gen, blob)
            if (ref.nbytes, ref.checksum) != (wm.blob.nbytes, wm.blob.checksum):
                raise SnapshotError(f"peer snapshot: worker {wid} fails its checksum")
            wm.blob = ref
    store.commit(meta, 0)
    return meta.gen
