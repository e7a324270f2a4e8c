"""Issue 13 (5, 6): snapshots degrade to slower, never to down.

Real RocksDB files are damaged (bit flips, truncation, deletion of every file of a
snapshot directory), writes fail (an injected error at the blob-write seam, a real full
file system on a small tmpfs), and in every case the store yields the newest generation
that is intact, or the previous one, or none (a full replay), never an index that differs
from a reference fold; writes recover once space returns; ``kvstream snapshot verify``
reports damage with a reason and exit 1, never a traceback."""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstream.replica.errors import SnapshotError
from kvstream.replica.snapshot import BlobRef, SnapshotStore, open_store
from kvstream.replica.snapshot_cli import snapshot as snapshot_cmd
from kvstream.replica.snapshotter import Snapshotter, restore_fold

from tests.replica.helpers import FakeWorkerLog, new_fold
from tests.replica.raw_store import raw_keys
from tests.replica.test_snapshot import PARTITIONS, feed, random_log, state

pytestmark = [pytest.mark.faults]


def two_generations(path: Path, seed: int = 21, crash_image: bool = False):
    """A store with two generations (the first of half of a random log, the second of
    all of it, every worker rewritten), the first in its own SST files, the second in
    SSTs too or (``crash_image``: the directory copied while open, as a crash leaves it)
    only in the write-ahead log; and the state each must restore to (reference folds)."""
    logs, _ = random_log(seed, workers=8, batches=30)
    # A large worker too, so that generations span many SST blocks (a flip then hits one).
    big = FakeWorkerLog(99, lease_ms=10**9)
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(16 * 3000)]
    logs[0].insert(0, (1, big.batch(big.cleared(), big.stored(tokens[: 16 * 1500]))))
    logs[0].append((10**6, big.batch(big.stored(tokens, start_block=1500))))
    half = {p: len(r) // 2 for p, r in logs.items()}
    ref1, ref2 = new_fold(), new_fold()
    feed(ref1, logs, half)
    feed(ref2, logs)
    fold = new_fold()
    feed(fold, logs, half)
    store = SnapshotStore(path)
    snap = Snapshotter(store, fold, "events", "tid", PARTITIONS, 0, 0)
    g1 = snap.snapshot_now()
    snap.close()
    base = snap.base
    store.close()  # flushes: generation 1 in its own SST
    feed(fold, logs, start=half)
    fold.dirty.update(fold.workers)
    store = SnapshotStore(path)
    snap = Snapshotter(store, fold, "events", "tid", PARTITIONS, 0, 0, base=base)
    g2 = snap.snapshot_now()
    snap.close()
    if crash_image:
        shutil.copytree(path, path.with_name(path.name + ".crash"))
    store.close()
    if crash_image:
        shutil.rmtree(path)
        path.with_name(path.name + ".crash").rename(path)
    return {g1: state(ref1), g2: state(ref2)}


def restored_state(store: SnapshotStore):
    loaded, skipped = store.load_latest()
    if loaded is None:
        return None, None, skipped
    meta, blobs = loaded
    fold = new_fold()
    restore_fold(fold, meta, blobs, set(meta.partitions))
    return meta.gen, state(fold), skipped


def damages(path: Path, rng: random.Random) -> Iterator[tuple[str, Path, str]]:
    """(kind, file, how) of damage to each file of a RocksDB directory."""
    for f in sorted(path.iterdir()):
        if f.name.startswith("LOG") or f.is_dir():
            continue  # RocksDB's info log: not data
        size = f.stat().st_size
        yield "delete", f, ""
        if size:
            yield "truncate", f, str(size // 2)
            for _ in range(4 if f.suffix == ".sst" else 2):
                yield "flip", f, f"{rng.randrange(size)}:{rng.randrange(8)}"


def apply_damage(f: Path, kind: str, how: str) -> None:
    if kind == "delete":
        f.unlink()
    elif kind == "truncate":
        os.truncate(f, int(how))
    else:
        pos, bit = map(int, how.split(":"))
        with open(f, "r+b") as fh:
            fh.seek(pos)
            byte = fh.read(1)[0]
            fh.seek(pos)
            fh.write(bytes([byte ^ (1 << bit)]))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("crash_image", [False, True], ids=["closed", "crash-image"])
def test_damaged_files_fall_back_newest_previous_replay(tmp_path: Path, crash_image: bool) -> None:
    """Every file of the directory deleted, truncated to half, or with single bits
    flipped: the store yields generation 2, or 1, or nothing, and what it yields equals
    the reference fold of that generation."""
    pristine = tmp_path / "pristine"
    expected = two_generations(pristine, crash_image=crash_image)
    g1, g2 = sorted(expected)
    rng = random.Random(5)
    outcomes: Counter[str] = Counter()
    runner = CliRunner()
    trials = 0
    for kind, f, how in list(damages(pristine, rng)):
        trials += 1
        work = tmp_path / f"t{trials}"
        shutil.copytree(pristine, work)
        apply_damage(work / f.name, kind, how)
        # verify first (read-only, as an operator would): a reason, never a traceback.
        out = runner.invoke(snapshot_cmd, ["verify", str(work)])
        assert out.exception is None or isinstance(out.exception, SystemExit), (kind, f.name, out.output)
        assert out.exit_code in (0, 1), (kind, f.name, out.output)
        # What a replica does at start: open (moving aside what cannot be opened), load.
        store, note = open_store(work)
        assert store is not None, note
        try:
            gen, got, skipped = restored_state(store)
        finally:
            store.close()
        if gen is None:
            outcomes["replay"] += 1
            assert note is not None or skipped, (kind, f.name)
        else:
            assert got == expected[gen], f"{kind} {f.name} {how}: generation {gen} restored a different index"
            outcomes["newest" if gen == g2 else "previous"] += 1
            # Generation 1 either because 2 was skipped (with the reason) or because the
            # damaged write-ahead log ended before 2's commit (RocksDB's point-in-time
            # recovery): then the store is as it was before generation 2.
            assert gen == g2 or skipped or crash_image, (kind, f.name, how)
        if out.exit_code == 0:
            # verify said the newest is intact: then it is what loads.
            assert out.output.startswith(f"generation {gen}: ok"), (kind, f.name, how, out.output)
        else:
            assert "BROKEN" in out.output or "Error" in out.output, out.output
        shutil.rmtree(work)
        for aside in tmp_path.glob(f"t{trials}.broken-*"):
            shutil.rmtree(aside)
    print(f"FAULTS snapshot_damage crash_image={crash_image} trials={trials} outcomes={dict(outcomes)}")
    # Every damage gave one of the three clean outcomes, and each of them occurs.
    assert outcomes["newest"] >= 1 and outcomes["replay"] >= 1, outcomes
    if crash_image:
        assert outcomes["previous"] >= 1, outcomes


def test_verify_and_load_catch_a_stale_blob(tmp_path: Path) -> None:
    """A meta that points a worker at an older blob (what a failed write used to leave)
    fails the stamp check: the previous generation loads, verify exits 1."""
    expected = two_generations(tmp_path / "s")
    g1, g2 = sorted(expected)
    store = SnapshotStore(tmp_path / "s")
    m1, m2 = store.meta(g1), store.meta(g2)
    wid, wm = next(iter(m2.workers()))
    wm.blob = dict(m1.workers())[wid].blob
    with raw_keys(store) as db:
        db[b"m" + struct.pack(">Q", g2)] = m2.to_bytes()
    gen, got, skipped = restored_state(store)
    store.close()
    assert gen == g1 and got == expected[g1] and "stale blob" in skipped[0]
    out = CliRunner().invoke(snapshot_cmd, ["verify", str(tmp_path / "s")])
    assert out.exit_code == 1 and "stale blob" in out.output, out.output


class FlakyStore(SnapshotStore):
    """The write seam failing: a blob write raises ``failures`` times (as a transient I/O
    error would), then works."""

    failures = 0

    def write_blob(self, worker: int, gen: int, blob: bytes) -> BlobRef:
        if self.failures:
            self.failures -= 1
            raise SnapshotError(f"writing worker {worker}'s blob: IO error: injected")
        return super().write_blob(worker, gen, blob)


def two_workers(blocks: int, seed: int):
    """A fold of two workers on partitions 0 and 1: worker 1 with the first half of
    ``blocks`` blocks of ``tokens``, worker 2 with two; (fold, w1, w2, tokens)."""
    fold = new_fold()
    w, other = FakeWorkerLog(1, lease_ms=10**9), FakeWorkerLog(2, lease_ms=10**9)
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(16 * blocks)]
    fold.apply_record(0, 0, 1, w.batch(w.cleared(), w.stored(tokens[: 16 * (blocks // 2)])))
    fold.apply_record(1, 0, 1, other.batch(other.cleared(), other.stored(tokens[:32])))
    return fold, w, other, tokens


def closed_and_restored(snap: Snapshotter, store: SnapshotStore):
    """Close ``snap`` with a final snapshot, then restore its store afresh:
    (generation, state, skipped)."""
    assert snap.close(final=True)
    store.close()
    store = SnapshotStore(store.path)
    try:
        return restored_state(store)
    finally:
        store.close()


def test_failed_blob_write_never_leaves_a_stale_pointer(tmp_path: Path) -> None:
    """Issue 13 (6): a worker with 1,000 blocks, then 2,000; the generation that held the
    2,000 failed to write; a later one must not point at the 1,000-block blob."""
    fold, w, other, tokens = two_workers(2000, seed=1)
    store = FlakyStore(tmp_path / "s")
    snap = Snapshotter(store, fold, "events", "tid", 2, 0, 0)
    snap.snapshot_now()
    fold.apply_record(0, 1, 2, w.batch(w.stored(tokens, start_block=1000)))
    store.failures = 1
    with pytest.raises(SnapshotError, match="injected"):
        snap.snapshot_now()
    # Only the other worker changes before the next generation.
    fold.apply_record(1, 1, 3, other.batch(other.stored(tokens[:64], start_block=2)))
    snap.snapshot_now()
    _, got, skipped = closed_and_restored(snap, store)
    assert not skipped and got == state(fold)
    blocks = {k.worker_id: sum(len(p.block_hashes) for p in fold.router.export_worker(k.worker_id)) for k in fold.router.workers()}
    assert blocks[1] == 2000


class GatedStore(SnapshotStore):
    """A slow disk: blob writes wait until the gate opens (``writing`` says one does)."""

    gate = threading.Event()
    writing = threading.Event()

    def write_blob(self, worker: int, gen: int, blob: bytes) -> BlobRef:
        self.writing.set()
        assert self.gate.wait(30)
        return super().write_blob(worker, gen, blob)


def test_a_generation_begun_while_the_last_is_written_points_at_no_stale_blob(tmp_path: Path) -> None:
    """Generation 2 rewrites worker 1 and is still being written when worker 2 changes:
    generation 3 must not point worker 1 at generation 1's blob (its state before 2).
    It used to, and the newest generation was then refused at load as a stale blob."""
    fold, w, other, tokens = two_workers(200, seed=2)
    store = GatedStore(tmp_path / "s")
    store.gate = threading.Event()
    store.gate.set()
    snap = Snapshotter(store, fold, "events", "tid", 2, 1, 0)
    snap.snapshot_now()
    store.gate.clear()
    store.writing = threading.Event()
    fold.apply_record(0, 1, 2, w.batch(w.stored(tokens, start_block=100)))
    snap.records_applied(1)
    snap.step()
    snap.step()  # generation 2 captured whole
    assert store.writing.wait(30)  # and its blob waits at the gate
    fold.apply_record(1, 1, 3, other.batch(other.stored(tokens[:64], start_block=2)))
    snap.records_applied(1)
    threading.Timer(1.0, store.gate.set).start()  # the old code's steps filled the queue
    snap.step()
    snap.step()
    gen, got, skipped = closed_and_restored(snap, store)
    assert not skipped and got == state(fold)
    assert gen == 3


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode == 0


def fill(path: Path) -> Path:
    """Fill the file system of ``path`` (a ballast file, written until ENOSPC)."""
    ballast = path / "ballast"
    # Unbuffered: a buffered file's close flushes the part the full disk refused again,
    # and raises ENOSPC out of the with.
    with open(ballast, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
        except OSError:
            pass
    return ballast


@pytest.mark.timeout(120)
def test_disk_full_then_space_returns(tmp_path: Path) -> None:
    """Issue 13 (6): on a full (real, tmpfs) file system snapshots fail, are counted and
    retried; once space returns the next one commits (no permanent "Writer has previous
    error"), the final one at close too, and it restores the live fold."""
    mnt = tmp_path / "mnt"
    if not mount_tmpfs(mnt, "24m"):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        logs, _ = random_log(3, workers=8, batches=30)
        half = {p: len(r) // 2 for p, r in logs.items()}
        fold = new_fold()
        feed(fold, logs, half)
        store = SnapshotStore(mnt / "snap")
        snap = Snapshotter(store, fold, "events", "tid", PARTITIONS, 0, 0)
        snap.snapshot_now()
        ballast = fill(mnt)
        feed(fold, logs, start=half)
        errors = []
        for _ in range(3):
            fold.dirty.update(fold.workers)
            try:
                snap.snapshot_now()
            except SnapshotError as exc:
                errors.append(str(exc))
        assert errors and any("space" in e.lower() or "error" in e.lower() for e in errors), errors
        ballast.unlink()
        gen = snap.snapshot_now()
        assert snap.close(final=True)
        store.close()
        store = SnapshotStore(mnt / "snap")
        got_gen, got, skipped = restored_state(store)
        store.close()
        assert got_gen == gen and got == state(fold) and not skipped
        print(f"FAULTS disk_full failures={snap.failures} first_error={errors[0][:120]!r}")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_store_locked_by_another_process_is_not_moved_aside(tmp_path: Path) -> None:
    """Two replicas on one directory is a configuration error: the second is refused with
    the reason; the first one's store stays where it is."""
    path = tmp_path / "s"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvstream.replica.snapshot import SnapshotStore; "
         "s = SnapshotStore(sys.argv[1]); print('open', flush=True); sys.stdin.read()", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(SnapshotError, match="another replica"):
            open_store(path)
        assert path.is_dir() and not list(tmp_path.glob("s.broken-*"))
    finally:
        holder.communicate("", timeout=30)


def test_read_only_file_system_runs_without_snapshots(tmp_path: Path) -> None:
    """A snapshot directory on a read-only file system: no start is refused; the store
    is reported unusable (the replica replays and takes no snapshots)."""
    mnt = tmp_path / "mnt"
    if not mount_tmpfs(mnt, "8m"):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        two_generations(mnt / "snap")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        for path in (mnt / "snap", mnt / "fresh"):
            store, note = open_store(path)
            assert store is None and note is not None and "without snapshots" in note, note
            assert "Read-only" in note or "read-only" in note.lower(), note
        # rocksdict writes its config file even when opening read-only: verify cannot
        # read it either, and says why.
        out = CliRunner().invoke(snapshot_cmd, ["verify", str(mnt / "snap")])
        assert out.exit_code == 1 and "Read-only file system" in out.output, out.output
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
