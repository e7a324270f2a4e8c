"""Snapshots of a replica's fold in RocksDB (rocksdict), for fast restart (DESIGN.md §7).

A snapshot generation holds, per partition of the events topic, the next offset to read,
its log clock, and the state of every worker on it (index blocks of every tier and rank,
epoch, last event ids, lease). Workers and their records live on one partition, so a
partition's part is consistent on its own: the consume loop captures one partition at a
time between batches (small steps, never a long stall) and a background thread writes.

Layout (raw keys, big-endian ints so that keys sort by worker and generation):

- ``b"w" + worker(8) + gen(8) + chunk(4)``: a worker's packed blocks, in 64 KiB values;
  written only when the worker changed (incremental), else the meta points at the
  generation that last wrote it;
- ``b"m" + gen(8)``: the generation's meta (JSON), prefixed with its XXH3-64 checksum;
  it lists each worker's blob generation, size and checksum;
- ``b"head"``: the newest committed generation and the previous one (the fallback).

A generation becomes visible only when its meta and ``head`` are written in one atomic
WriteBatch; blobs referenced by neither the newest nor the previous generation are then
deleted. On load, a generation whose meta or any blob fails its checksum is skipped for
the previous one.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
import xxhash
from rocksdict import AccessType, Options, Rdict, WriteBatch, WriteOptions

from kvstream.events.model import Tier
from kvstream.router.index import PackedBlocks, WorkerBlocks
from kvstream.replica.errors import SnapshotError

CHUNK_BYTES = 64 * 1024
_HEAD = b"head"
_TIERS = list(Tier)
_U64 = np.dtype("<u8")


# -- worker blobs -----------------------------------------------------------------------


def pack_worker(parts: list[WorkerBlocks]) -> bytes:
    out = [struct.pack("<I", len(parts))]
    for p in parts:
        n = len(p.block_hashes)
        out.append(struct.pack("<IBQ", p.dp_rank, _TIERS.index(p.tier), n))
        out.append(np.fromiter(p.block_hashes, _U64, n).tobytes())
        out.append(np.fromiter(p.seq_hashes, _U64, n).tobytes())
    return b"".join(out)


def packed_worker(blob: bytes) -> list[PackedBlocks]:
    """The parts of a worker blob, hashes left packed (what a restore imports)."""
    try:
        (count,) = struct.unpack_from("<I", blob, 0)
        pos, parts = 4, []
        for _ in range(count):
            rank, tier, n = struct.unpack_from("<IBQ", blob, pos)
            pos += 13
            if pos + 16 * n > len(blob):
                raise SnapshotError("worker blob is shorter than its header says")
            parts.append(PackedBlocks(rank, _TIERS[tier], blob, pos, n))
            pos += 16 * n
    except (struct.error, IndexError) as exc:
        raise SnapshotError(f"malformed worker blob: {exc}") from None
    if pos != len(blob):
        raise SnapshotError("worker blob has trailing bytes")
    return parts


def unpack_worker(blob: bytes) -> list[WorkerBlocks]:
    """The parts of a worker blob, hashes as lists of ints."""
    return [
        WorkerBlocks(
            p.dp_rank, p.tier,
            np.frombuffer(blob, _U64, p.count, p.offset).tolist(),
            np.frombuffer(blob, _U64, p.count, p.offset + 8 * p.count).tolist(),
        )
        for p in packed_worker(blob)
    ]


# -- meta ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlobRef:
    gen: int
    nbytes: int
    checksum: int


@dataclass(slots=True)
class WorkerMeta:
    """The fold's record of one worker, plus where its blocks are stored."""

    epoch: int
    lease_ms: int
    last_seen_ms: int
    last_ids: dict[int, int]
    blob: BlobRef


@dataclass(slots=True)
class PartitionMeta:
    next_offset: int
    log_time_ms: int
    workers: dict[int, WorkerMeta] = field(default_factory=dict)


@dataclass(slots=True)
class SnapshotMeta:
    gen: int
    topic: str
    topic_id: str | None
    partition_count: int
    created_ms: int
    partitions: dict[int, PartitionMeta] = field(default_factory=dict)
    #: Fold counters at the time of the snapshot (for operators; not state).
    counters: dict[str, int] = field(default_factory=dict)

    def next_offsets(self) -> dict[int, int]:
        return {p: m.next_offset for p, m in sorted(self.partitions.items())}

    def blocks(self) -> int:
        return sum(w.blob.nbytes for p in self.partitions.values() for w in p.workers.values()) // 16

    def to_bytes(self) -> bytes:
        doc = {
            "gen": self.gen,
            "topic": self.topic,
            "topic_id": self.topic_id,
            "partition_count": self.partition_count,
            "created_ms": self.created_ms,
            "counters": self.counters,
            "partitions": {
                str(p): {
                    "next_offset": pm.next_offset,
                    "log_time_ms": pm.log_time_ms,
                    "workers": {
                        str(w): {
                            "epoch": wm.epoch,
                            "lease_ms": wm.lease_ms,
                            "last_seen_ms": wm.last_seen_ms,
                            "last_ids": {str(r): i for r, i in wm.last_ids.items()},
                            "blob": [wm.blob.gen, wm.blob.nbytes, wm.blob.checksum],
                        }
                        for w, wm in pm.workers.items()
                    },
                }
                for p, pm in self.partitions.items()
            },
        }
        body = orjson.dumps(doc)
        return xxhash.xxh3_64_intdigest(body).to_bytes(8, "big") + body

    @classmethod
    def from_bytes(cls, raw: bytes) -> SnapshotMeta:
        if len(raw) < 8 or xxhash.xxh3_64_intdigest(raw[8:]) != int.from_bytes(raw[:8], "big"):
            raise SnapshotError("snapshot meta fails its checksum")
        try:
            doc = orjson.loads(raw[8:])
            meta = cls(
                doc["gen"], doc["topic"], doc["topic_id"], doc["partition_count"], doc["created_ms"],
                counters=doc.get("counters", {}),
            )
            for p, pd in doc["partitions"].items():
                pm = meta.partitions[int(p)] = PartitionMeta(pd["next_offset"], pd["log_time_ms"])
                for w, wd in pd["workers"].items():
                    pm.workers[int(w)] = WorkerMeta(
                        wd["epoch"], wd["lease_ms"], wd["last_seen_ms"],
                        {int(r): i for r, i in wd["last_ids"].items()}, BlobRef(*wd["blob"]),
                    )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise SnapshotError(f"malformed snapshot meta: {exc}") from None
        return meta


# -- the store ----------------------------------------------------------------------------


def _blob_key(worker: int, gen: int, chunk: int) -> bytes:
    return b"w" + struct.pack(">QQI", worker, gen, chunk)


def _meta_key(gen: int) -> bytes:
    return b"m" + struct.pack(">Q", gen)


class SnapshotStore:
    """A directory holding a replica's snapshot generations."""

    def __init__(self, path: str | Path, read_only: bool = False) -> None:
        """``read_only`` opens a store that a running replica holds (for inspection and
        replay); such a store cannot be written."""
        self.path = Path(path)
        try:
            opts = Options(raw_mode=True)
            if read_only:
                self._db = Rdict(str(self.path), opts, access_type=AccessType.read_only())
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                opts.create_if_missing(True)
                self._db = Rdict(str(self.path), opts)
        except Exception as exc:  # rocksdict raises plain Exceptions for I/O problems
            raise SnapshotError(f"cannot open snapshot store {self.path}: {exc}") from None
        self._sync = WriteOptions()
        self._sync.sync = True

    def close(self) -> None:
        self._db.close()

    # -- writing --------------------------------------------------------------------

    def head(self) -> tuple[int, int] | None:
        """(newest, previous) generation numbers, or None when nothing was committed."""
        raw = self._db.get(_HEAD)
        if raw is None:
            return None
        newest, prev = struct.unpack(">QQ", raw)
        return newest, prev

    def next_gen(self) -> int:
        head = self.head()
        return head[0] + 1 if head else 1

    def write_blob(self, worker: int, gen: int, blob: bytes) -> BlobRef:
        """Write a worker's blob for generation ``gen`` (invisible until commit)."""
        wb = WriteBatch(raw_mode=True)
        for i, start in enumerate(range(0, max(len(blob), 1), CHUNK_BYTES)):
            wb.put(_blob_key(worker, gen, i), blob[start : start + CHUNK_BYTES])
        self._db.write(wb)
        return BlobRef(gen, len(blob), xxhash.xxh3_64_intdigest(blob))

    def commit(self, meta: SnapshotMeta, prev: int) -> None:
        """Make ``meta``'s generation the newest, atomically, with ``prev`` (the last
        generation known good, 0 for none) as its fallback; delete the rest."""
        wb = WriteBatch(raw_mode=True)
        wb.put(_meta_key(meta.gen), meta.to_bytes())
        wb.put(_HEAD, struct.pack(">QQ", meta.gen, prev))
        self._db.write(wb, self._sync)
        self._collect(keep=(meta.gen, prev))

    def _collect(self, keep: tuple[int, int]) -> None:
        """Delete metas and blobs that neither kept generation references."""
        live: set[tuple[int, int]] = set()
        for gen in keep:
            meta = self._try_meta(gen)
            if meta is not None:
                for pm in meta.partitions.values():
                    live.update((w, wm.blob.gen) for w, wm in pm.workers.items())
        wb = WriteBatch(raw_mode=True)
        for key in self._db.keys(from_key=b"m"):
            if not key.startswith(b"m"):
                break
            if struct.unpack(">Q", key[1:])[0] not in keep:
                wb.delete(key)
        for key in self._db.keys(from_key=b"w"):
            if not key.startswith(b"w"):
                break
            worker, gen, _ = struct.unpack(">QQI", key[1:])
            if (worker, gen) not in live and gen <= max(keep):
                wb.delete(key)
        if wb.len():
            self._db.write(wb)

    # -- reading --------------------------------------------------------------------

    def _try_meta(self, gen: int) -> SnapshotMeta | None:
        raw = self._db.get(_meta_key(gen)) if gen else None
        if raw is None:
            return None
        try:
            return SnapshotMeta.from_bytes(raw)
        except SnapshotError:
            return None

    def read_blob(self, worker: int, ref: BlobRef) -> bytes:
        chunks = []
        for i in range(max(1, -(-ref.nbytes // CHUNK_BYTES))):
            chunk = self._db.get(_blob_key(worker, ref.gen, i))
            if chunk is None:
                raise SnapshotError(f"worker {worker}: chunk {i} of generation {ref.gen} is missing")
            chunks.append(chunk)
        blob = b"".join(chunks)
        if len(blob) != ref.nbytes or xxhash.xxh3_64_intdigest(blob) != ref.checksum:
            raise SnapshotError(f"worker {worker}: blob of generation {ref.gen} fails its checksum")
        return blob

    def load(self, gen: int) -> tuple[SnapshotMeta, dict[int, bytes]]:
        """Generation ``gen`` with every worker blob verified, or SnapshotError."""
        raw = self._db.get(_meta_key(gen))
        if raw is None:
            raise SnapshotError(f"generation {gen} has no meta")
        meta = SnapshotMeta.from_bytes(raw)
        blobs = {
            w: self.read_blob(w, wm.blob)
            for pm in meta.partitions.values()
            for w, wm in pm.workers.items()
        }
        return meta, blobs

    def load_latest(self) -> tuple[tuple[SnapshotMeta, dict[int, bytes]] | None, list[str]]:
        """The newest generation that verifies, else the previous one, else None; and why
        each skipped generation was skipped."""
        skipped: list[str] = []
        for gen in self.head() or ():
            if not gen:
                continue
            try:
                return self.load(gen), skipped
            except SnapshotError as exc:
                skipped.append(f"generation {gen}: {exc}")
        return None, skipped

    def raw_items(self) -> Iterator[tuple[bytes, bytes]]:
        """Every key/value (for inspection and tests that damage a snapshot)."""
        yield from self._db.items()

    def put_raw(self, key: bytes, value: bytes) -> None:
        self._db.put(key, value)

    def workers_of(self, meta: SnapshotMeta) -> Mapping[int, WorkerMeta]:
        return {w: wm for pm in meta.partitions.values() for w, wm in pm.workers.items()}
