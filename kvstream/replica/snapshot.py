"""Snapshots of a replica's fold in RocksDB (rocksdict), for fast restart (DESIGN.md §7).

A snapshot generation holds, per partition of the events topic, the next offset to read,
its log clock, and the state of every worker on it (index blocks of every tier and rank,
epoch, last event ids, lease). Workers and their records live on one partition, so a
partition's part is consistent on its own: the consume loop captures one partition at a
time between batches (small steps, never a long stall) and a background thread writes.

Layout (raw keys, big-endian ints so that keys sort by worker and generation):

- ``b"w" + worker(8) + gen(8) + chunk(4)``: a worker's index tables, in 64 KiB values;
  written only when the worker changed (incremental), else the meta points at the
  generation that last wrote it. Since format 3 a blob holds each (rank, tier) reverse
  table of the core as its raw arrays (``kvstream._native.WorkerTables``' layout): a
  restore copies them, checks their structure, and builds the shared owners tables once,
  instead of inserting every block (format 2 held the (block hash, position) pairs; a
  generation of an older format is refused with that reason and the log replayed);
- ``b"m" + gen(8)``: the generation's meta (JSON), prefixed with its XXH3-64 checksum;
  it lists each worker's blob generation, size and checksum;
- ``b"head"``: the newest committed generation and the previous one (the fallback).

A generation becomes visible only when its meta and ``head`` are written in one atomic
WriteBatch; blobs referenced by neither the newest nor the previous generation are then
deleted. Each stored blob starts with a *stamp*, a digest of the worker's fold position
when it was captured (worker id, epoch, last event ids, last seen): a meta that points a
worker at a blob of another position (an old blob after a failed write) fails the check.

Snapshots degrade to slower, never to down: on load, a generation whose meta or any blob
fails its checksum or stamp, or that RocksDB cannot read ("Corruption: ..."), is skipped
for the previous one, then for none (a full replay); a directory RocksDB cannot even open
is moved aside (:func:`open_store`). Every RocksDB error is a :class:`SnapshotError`.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import orjson
import xxhash
from rocksdict import AccessType, Options, Rdict, WriteBatch, WriteOptions

from kvstream.logs import get_logger
from kvstream.replica.errors import SnapshotError
from kvstream.router.index import TIERS, WorkerBlocks, WorkerTables

log = get_logger(__name__)

CHUNK_BYTES = 64 * 1024
#: Version of the layout; a generation of another version is skipped (replayed instead).
FORMAT = 3
STAMP_BYTES = 8
_HEAD = b"head"
_T = TypeVar("_T")


# -- worker blobs -----------------------------------------------------------------------


def worker_tables(blob: bytes, start: int = 0) -> WorkerTables:
    """The tables of a worker blob from byte ``start`` on, checked (lengths, structure);
    SnapshotError saying what is wrong with a damaged one."""
    try:
        return WorkerTables.parse(blob, start)
    except ValueError as exc:
        raise SnapshotError(f"malformed worker blob: {exc}") from None


def stamp(worker: int, epoch: int, last_ids: Mapping[int, int], last_seen_ms: int) -> bytes:
    """The fold position a blob was captured at, as a digest (the first bytes of a
    stored blob): a meta whose worker record differs did not capture this blob."""
    ids = sorted(last_ids.items())
    raw = struct.pack(f">QQqI{2 * len(ids)}Q", worker, epoch, last_seen_ms, len(ids), *(x for kv in ids for x in kv))
    return xxhash.xxh3_64_digest(raw)


def unpack_worker(tables: WorkerTables) -> list[WorkerBlocks]:
    """The parts of a worker's tables, hashes as lists of ints."""
    return [WorkerBlocks(rank, TIERS[tier], h, s) for rank, tier, h, s in tables.lists()]


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
    #: rank → {event id: digest} of the fold's recent window (kvstream.replica.fold.
    #: WorkerLog.recent): a restarted replica still tells a reused id from a redelivery.
    recent: dict[int, dict[int, int]] = field(default_factory=dict)
    #: Whether the worker stored anything in its epoch (fold.WorkerLog.stored).
    stored: bool = True
    #: Blocks in its blob (for operators and metrics).
    blocks: int = 0

    def stamp(self, worker: int) -> bytes:
        return stamp(worker, self.epoch, self.last_ids, self.last_seen_ms)


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

    def workers(self) -> Iterator[tuple[int, WorkerMeta]]:
        for pm in self.partitions.values():
            yield from pm.workers.items()

    def blocks(self) -> int:
        return sum(w.blocks for _, w in self.workers())

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
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
                            "recent": {str(r): list(d.items()) for r, d in wm.recent.items()},
                            "stored": wm.stored,
                            "blocks": wm.blocks,
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
            if doc.get("format") != FORMAT:
                raise SnapshotError(f"snapshot format {doc.get('format', 1)} is not {FORMAT} (an older version wrote it)")
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
                        {int(r): {int(i): int(d) for i, d in pairs} for r, pairs in wd["recent"].items()},
                        bool(wd["stored"]), int(wd["blocks"]),
                    )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SnapshotError(f"malformed snapshot meta: {exc}") from None
        return meta


# -- the store ----------------------------------------------------------------------------


def _blob_key(worker: int, gen: int, chunk: int) -> bytes:
    return b"w" + struct.pack(">QQI", worker, gen, chunk)


def _meta_key(gen: int) -> bytes:
    return b"m" + struct.pack(">Q", gen)


class BlobWriter:
    """Writes one worker blob chunk by chunk (bounded memory, e.g. from a peer's stream);
    invisible until the generation commits."""

    def __init__(self, store: SnapshotStore, worker: int, gen: int) -> None:
        self._store, self._worker, self._gen = store, worker, gen
        self._buf = bytearray()
        self._chunk = 0
        self._nbytes = 0
        self._hash = xxhash.xxh3_64()

    def write(self, data: bytes) -> None:
        self._hash.update(data)
        self._nbytes += len(data)
        self._buf += data
        while len(self._buf) >= CHUNK_BYTES:
            self._put(bytes(self._buf[:CHUNK_BYTES]))
            del self._buf[:CHUNK_BYTES]

    def _put(self, chunk: bytes) -> None:
        key = _blob_key(self._worker, self._gen, self._chunk)
        self._store._call(f"writing worker {self._worker}'s blob", lambda: self._store._db.put(key, chunk))
        self._chunk += 1

    def finish(self) -> BlobRef:
        if self._buf or not self._chunk:
            self._put(bytes(self._buf))
        return BlobRef(self._gen, self._nbytes, self._hash.intdigest())


class SnapshotStore:
    """A directory holding a replica's snapshot generations."""

    def __init__(self, path: str | Path, read_only: bool = False) -> None:
        """``read_only`` opens a store that a running replica holds (for inspection and
        replay); such a store cannot be written."""
        self.path = Path(path)
        self.read_only = read_only
        #: Serialises reopen() against readers of other threads (the HTTP snapshot stream).
        self._lock = threading.RLock()
        self._closed = False
        self._db: Rdict | None = self._open()
        self._sync = WriteOptions()
        self._sync.sync = True

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run a RocksDB call (under the lock, so never against a database that reopen()
        is replacing); its errors (plain Exceptions from rocksdict: "Corruption: block
        checksum mismatch", "IO error: No space left on device", "Writer has previous
        error") become SnapshotErrors that say what was being done."""
        with self._lock:
            try:
                if self._db is None:
                    if self._closed:
                        raise SnapshotError("the snapshot store is closed")
                    self._db = self._open()  # a reopen() failed (still no space): again
                return fn()
            except SnapshotError:
                raise
            except Exception as exc:
                raise SnapshotError(f"{what}: {exc}") from None

    def _open(self) -> Rdict:
        try:
            opts = Options(raw_mode=True)
            # Verify every block read (the default in RocksDB; said so to keep it so).
            opts.set_paranoid_checks(True)
            if self.read_only:
                return Rdict(str(self.path), opts, access_type=AccessType.read_only())
            self.path.parent.mkdir(parents=True, exist_ok=True)
            opts.create_if_missing(True)
            db = Rdict(str(self.path), opts)
            self._identity = _identity(self.path)
            return db
        except Exception as exc:  # rocksdict raises plain Exceptions for I/O problems
            raise SnapshotError(f"cannot open snapshot store {self.path}: {exc}") from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            db, self._db = self._db, None
            if db is None:
                return
            try:
                db.close()
            except Exception as exc:  # a failed flush at close loses nothing committed
                log.warning("snapshot store close failed", path=str(self.path), error=str(exc))

    def reopen(self) -> None:
        """Close and open the database again: after a failed write (disk full) RocksDB
        refuses every later write ("Writer has previous error") until reopened."""
        with self._lock:
            self.close()
            self._closed = False
            self._db = self._open()

    # -- writing --------------------------------------------------------------------

    def head(self) -> tuple[int, int] | None:
        """(newest, previous) generation numbers, or None when nothing was committed."""
        raw = self._call("reading the head", lambda: self._db.get(_HEAD))
        if raw is None:
            return None
        if len(raw) != 16:
            raise SnapshotError("the head record is malformed")
        newest, prev = struct.unpack(">QQ", raw)
        return newest, prev

    def next_gen(self) -> int:
        try:
            head = self.head()
        except SnapshotError:
            head = None
        return max([head[0] if head else 0, *self.meta_gens()]) + 1

    def meta_gens(self) -> list[int]:
        """Generations that have a meta key, newest first (fallback when ``head`` is
        unreadable); [] when even the keys cannot be listed."""
        def scan() -> list[int]:
            gens = []
            for key in self._db.keys(from_key=b"m"):
                if not key.startswith(b"m"):
                    break
                if len(key) == 9:
                    gens.append(struct.unpack(">Q", key[1:])[0])
            return sorted(gens, reverse=True)
        try:
            return self._call("listing generations", scan)
        except SnapshotError:
            return []

    def blob_writer(self, worker: int, gen: int) -> BlobWriter:
        return BlobWriter(self, worker, gen)

    def write_blob(self, worker: int, gen: int, blob: bytes) -> BlobRef:
        """Write a worker's stored blob (stamp + packed blocks) for generation ``gen``
        (invisible until commit)."""
        wb = WriteBatch(raw_mode=True)
        for i, start in enumerate(range(0, max(len(blob), 1), CHUNK_BYTES)):
            wb.put(_blob_key(worker, gen, i), blob[start : start + CHUNK_BYTES])
        self._call(f"writing worker {worker}'s blob", lambda: self._db.write(wb))
        return BlobRef(gen, len(blob), xxhash.xxh3_64_intdigest(blob))

    def discard_blob(self, worker: int, gen: int) -> None:
        """Delete a blob written for a generation that will not be committed."""
        self._call(
            f"discarding worker {worker}'s blob",
            lambda: self._db.delete_range(_blob_key(worker, gen, 0), _blob_key(worker, gen + 1, 0)),
        )

    def commit(self, meta: SnapshotMeta, prev: int) -> None:
        """Make ``meta``'s generation the newest, atomically, with ``prev`` (the last
        generation known good, 0 for none) as its fallback; delete the rest."""
        if not self.read_only and _identity(self.path) != self._identity:
            # RocksDB writes on into the files it has open: a commit would succeed, into
            # files nobody can read again.
            raise SnapshotError(f"the snapshot directory {self.path} was deleted or replaced under the replica")
        wb = WriteBatch(raw_mode=True)
        wb.put(_meta_key(meta.gen), meta.to_bytes())
        wb.put(_HEAD, struct.pack(">QQ", meta.gen, prev))
        self._call(f"committing generation {meta.gen}", lambda: self._db.write(wb, self._sync))
        try:
            self._collect(keep=(meta.gen, prev))
        except SnapshotError as exc:  # the commit stands; the next one collects
            log.warning("snapshot collection failed", error=str(exc))

    def _collect(self, keep: tuple[int, int]) -> None:
        """Delete metas and blobs that neither kept generation references."""
        live: set[tuple[int, int]] = set()
        for gen in keep:
            meta = self._try_meta(gen)
            if meta is not None:
                live.update((w, wm.blob.gen) for w, wm in meta.workers())

        def collect() -> None:
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

        self._call("collecting old generations", collect)

    # -- reading --------------------------------------------------------------------

    def _try_meta(self, gen: int) -> SnapshotMeta | None:
        try:
            return self.meta(gen) if gen else None
        except SnapshotError:
            return None

    def meta(self, gen: int) -> SnapshotMeta:
        raw = self._call(f"reading generation {gen}'s meta", lambda: self._db.get(_meta_key(gen)))
        if raw is None:
            raise SnapshotError(f"generation {gen} has no meta")
        meta = SnapshotMeta.from_bytes(raw)
        if meta.gen != gen:
            raise SnapshotError(f"generation {gen}'s meta says generation {meta.gen}")
        return meta

    def blob_chunks(self, worker: int, ref: BlobRef) -> Iterator[bytes]:
        """A stored blob's chunks, in order; SnapshotError (after the last chunk, at the
        latest) when a chunk is missing or the whole fails its length or checksum."""
        h = xxhash.xxh3_64()
        n = 0
        for i in range(max(1, -(-ref.nbytes // CHUNK_BYTES))):
            key = _blob_key(worker, ref.gen, i)
            chunk = self._call(f"worker {worker}: reading generation {ref.gen}", lambda: self._db.get(key))
            if chunk is None:
                raise SnapshotError(f"worker {worker}: chunk {i} of generation {ref.gen} is missing")
            h.update(chunk)
            n += len(chunk)
            if n > ref.nbytes:
                break
            yield chunk
        if n != ref.nbytes or h.intdigest() != ref.checksum:
            raise SnapshotError(f"worker {worker}: blob of generation {ref.gen} fails its checksum")

    def read_blob(self, worker: int, ref: BlobRef) -> bytes:
        """A stored blob, checksum verified (stamp included)."""
        return b"".join(self.blob_chunks(worker, ref))

    def load(self, gen: int) -> tuple[SnapshotMeta, dict[int, WorkerTables]]:
        """Generation ``gen`` with every worker blob verified (checksum, stamp, then the
        tables' lengths and structure), or SnapshotError: nothing of a damaged generation
        reaches an index."""
        meta = self.meta(gen)
        blobs = {}
        for w, wm in meta.workers():
            blob = self.read_blob(w, wm.blob)
            if blob[:STAMP_BYTES] != wm.stamp(w):
                raise SnapshotError(
                    f"worker {w}: the blob of generation {wm.blob.gen} was captured at another "
                    f"position of the log than generation {gen} records (a stale blob)"
                )
            blobs[w] = worker_tables(blob, STAMP_BYTES)
        return meta, blobs

    def candidates(self) -> tuple[list[int], list[str]]:
        """Generations to try, newest first: the head's, or (head unreadable) every meta."""
        try:
            head = self.head()
            return [g for g in head or () if g], []
        except SnapshotError as exc:
            return self.meta_gens(), [f"head: {exc}"]

    def load_latest(self) -> tuple[tuple[SnapshotMeta, dict[int, WorkerTables]] | None, list[str]]:
        """The newest generation that verifies, else the previous one, else None; and why
        each skipped generation was skipped."""
        gens, skipped = self.candidates()
        for gen in gens:
            try:
                return self.load(gen), skipped
            except SnapshotError as exc:
                skipped.append(f"generation {gen}: {exc}")
        return None, skipped

    def latest_meta(self) -> tuple[SnapshotMeta | None, list[str]]:
        """The newest generation whose meta verifies (its blobs unread), for streaming."""
        gens, skipped = self.candidates()
        for gen in gens:
            try:
                return self.meta(gen), skipped
            except SnapshotError as exc:
                skipped.append(f"generation {gen}: {exc}")
        return None, skipped


def _identity(path: Path) -> tuple[int, int] | None:
    """The directory's (device, inode); None when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def open_store(path: Path) -> tuple[SnapshotStore | None, str | None]:
    """The writable store at ``path`` and, when it could not be used as it was, why.
    A store that RocksDB cannot open (a damaged MANIFEST, a deleted or truncated file) is
    moved aside to ``<path>.broken-<time>`` (kept for inspection) and a new one is made:
    the replica replays instead of refusing to start. If even that fails (a read-only or
    full file system), None: the replica runs without snapshots. A store locked by
    another process is a SnapshotError (two replicas must not share a directory)."""
    try:
        return SnapshotStore(path), None
    except SnapshotError as exc:
        reason = str(exc)
    if "/LOCK" in reason:
        # Another process holds it (two replicas on one directory): a configuration
        # error, not damage; moving it aside would take it from under that process.
        raise SnapshotError(f"{reason} (is another replica using this snapshot directory?)")
    if path.exists():
        aside = path.with_name(f"{path.name}.broken-{int(time.time() * 1000)}")
        try:
            path.rename(aside)
            reason += f"; moved aside to {aside}"
        except OSError as exc:
            return None, f"{reason}; cannot move it aside ({exc.strerror}): running without snapshots"
    try:
        return SnapshotStore(path), reason
    except SnapshotError as exc:
        return None, f"{reason}; {exc}: running without snapshots"
