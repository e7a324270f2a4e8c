"""Snapshots (kvstream.replica.snapshot/snapshotter): restore equals the fold it was taken
from, incrementally, atomically, and a damaged generation falls back to the previous."""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream.events.model import Tier
from kvstream.hashing import local_hashes
from kvstream.replica.errors import SnapshotError
from kvstream.replica.snapshot import SnapshotStore
from kvstream.replica.snapshotter import Snapshotter, restore_fold

from tests.replica.helpers import FakeWorkerLog, new_fold
from tests.replica.raw_store import raw_keys

PARTITIONS = 3
TIERS = list(Tier)


def random_log(seed: int, workers: int = 6, batches: int = 15):
    """Records per partition: random stores/removes/clears over a few shared prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(16 * 6)] for _ in range(4)]
    logs: dict[int, list[tuple[int, bytes]]] = {p: [] for p in range(PARTITIONS)}
    for wid in range(1, workers + 1):
        w = FakeWorkerLog(wid, epoch=rng.randrange(1, 5), ranks=2, lease_ms=10**9)
        p = wid % PARTITIONS
        t = 1
        logs[p].append((t, w.batch(w.cleared(0))))
        held: list[tuple[list[int], int, Tier]] = []
        for _ in range(batches):
            t += 1
            events = []
            for _ in range(rng.randrange(1, 4)):
                roll = rng.random()
                rank = rng.randrange(2)
                tier = rng.choice(TIERS)
                if roll < 0.7 or not held:
                    toks = rng.choice(prefixes)[: 16 * rng.randrange(1, 7)]
                    toks = toks + [rng.randrange(1000) for _ in range(16 * rng.randrange(0, 3))]
                    events.append(w.stored(toks, rank, tier))
                    held.append((toks, rank, tier))
                elif roll < 0.95:
                    toks, rank, tier = held.pop(rng.randrange(len(held)))
                    n = len(toks) // 16
                    events.append(w.removed(toks, rank, tier, start_block=rng.randrange(n)))
                else:
                    events.append(w.cleared(rank))
                    held.clear()
            logs[p].append((t, w.batch(*events)))
    return logs, prefixes


def feed(fold, logs, upto: dict[int, int] | None = None, start: dict[int, int] | None = None) -> None:
    for p, records in logs.items():
        lo = (start or {}).get(p, 0)
        hi = (upto or {}).get(p, len(records))
        for off in range(lo, hi):
            ts, value = records[off]
            fold.apply_record(p, off, ts, value)


def state(fold):
    index = fold.router
    workers = {}
    for wid in sorted({k.worker_id for k in index.workers()}):
        workers[wid] = sorted(
            (p.dp_rank, p.tier.value, tuple(sorted(zip(p.block_hashes, p.seq_hashes))))
            for p in index.export_worker(wid)
        )
    logs = {w: (l.partition, l.epoch, l.lease_ms, l.last_seen_ms, dict(l.last_ids)) for w, l in fold.workers.items()}
    parts = {p: (s.next_offset, s.log_time_ms) for p, s in fold.partitions.items()}
    return workers, logs, parts


def matches(fold, prefixes):
    return [fold.router.find_matches_by_tier(local_hashes(p)) for p in prefixes]


def snapshot(tmp_path, fold, name="snap", base=None):
    store = SnapshotStore(tmp_path / name)
    snap = Snapshotter(store, fold, "events", "topic-id", PARTITIONS, 0, 0, base=base)
    gen = snap.snapshot_now()
    return store, snap, gen


def restore(store):
    loaded, skipped = store.load_latest()
    assert loaded is not None, skipped
    meta, blobs = loaded
    fold = new_fold()
    restore_fold(fold, meta, blobs, set(meta.partitions))
    return fold, meta, skipped


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), cut=st.integers(1, 15))
def test_restored_fold_equals_original_and_keeps_folding(tmp_path_factory, seed: int, cut: int) -> None:
    tmp_path = tmp_path_factory.mktemp("snap")
    logs, prefixes = random_log(seed)
    upto = {p: min(cut, len(r)) for p, r in logs.items()}
    live = new_fold()
    feed(live, logs, upto)
    store, snap, _ = snapshot(tmp_path, live)
    snap.close()
    restored, meta, _ = restore(store)
    assert state(restored) == state(live)
    assert matches(restored, prefixes) == matches(live, prefixes)
    assert meta.next_offsets() == {p: upto[p] for p in range(PARTITIONS)}
    # The rest of the log (re-reading the last record too: a duplicate) folds the same.
    again = {p: max(0, upto[p] - 1) for p in upto}
    feed(live, logs, start=upto)
    feed(restored, logs, start=again)
    assert state(restored)[0] == state(live)[0]
    assert matches(restored, prefixes) == matches(live, prefixes)
    store.close()


def test_incremental_snapshot_rewrites_only_changed_workers(tmp_path) -> None:
    logs, _ = random_log(7)
    fold = new_fold()
    feed(fold, logs)
    store, snap, g1 = snapshot(tmp_path, fold)
    w = FakeWorkerLog(2, epoch=99, lease_ms=10**9)
    fold.apply_record(2, len(logs[2]), 10_000, w.batch(w.cleared(), w.stored(list(range(64)))))
    g2 = snap.snapshot_now()
    meta = snap.base
    assert meta is not None and meta.gen == g2 > g1
    gens = {wid: wm.blob.gen for pm in meta.partitions.values() for wid, wm in pm.workers.items()}
    assert gens[2] == g2
    assert all(g == g1 for wid, g in gens.items() if wid != 2)
    snap.close()
    restored, _, _ = restore(store)
    assert state(restored) == state(fold)


def _damage(store: SnapshotStore, prefix: bytes) -> None:
    with raw_keys(store) as db:
        for key, value in list(db.items()):
            if key.startswith(prefix):
                db.put(key, value[:-1] + bytes([value[-1] ^ 0xFF]))
                return
    raise AssertionError(f"no key with prefix {prefix!r}")


@pytest.mark.parametrize("what", ["meta", "blob"])
def test_damaged_newest_generation_falls_back_to_previous(tmp_path, what: str) -> None:
    logs, _ = random_log(11)
    fold = new_fold()
    half = {p: len(r) // 2 for p, r in logs.items()}
    feed(fold, logs, half)
    store, snap, g1 = snapshot(tmp_path, fold)
    first = state(fold)
    feed(fold, logs, start=half)
    fold.dirty.update(fold.workers)  # rewrite every blob in the second generation
    g2 = snap.snapshot_now()
    snap.close()
    assert store.head() == (g2, g1)
    if what == "meta":
        _damage(store, b"m" + struct.pack(">Q", g2))
    else:
        _damage(store, b"w" + struct.pack(">Q", 1) + struct.pack(">Q", g2))
    restored, meta, skipped = restore(store)
    assert meta.gen == g1 and len(skipped) == 1 and f"generation {g2}" in skipped[0]
    assert state(restored) == first


def test_no_valid_generation_means_no_snapshot(tmp_path) -> None:
    logs, _ = random_log(3)
    fold = new_fold()
    feed(fold, logs)
    store, snap, g1 = snapshot(tmp_path, fold)
    snap.close()
    _damage(store, b"m" + struct.pack(">Q", g1))
    loaded, skipped = store.load_latest()
    assert loaded is None and len(skipped) == 1


def test_old_generations_are_collected(tmp_path) -> None:
    logs, _ = random_log(5)
    fold = new_fold()
    feed(fold, logs)
    store, snap, _ = snapshot(tmp_path, fold)
    for _ in range(4):
        fold.dirty.update(fold.workers)
        snap.snapshot_now()
    snap.close()
    newest, prev = store.head()  # type: ignore[misc]
    with raw_keys(store) as db:
        keys = list(db.keys())
    metas = {struct.unpack(">Q", k[1:])[0] for k in keys if k.startswith(b"m")}
    blob_gens = {struct.unpack(">QQI", k[1:])[1] for k in keys if k.startswith(b"w")}
    assert metas == {newest, prev} and blob_gens <= {newest, prev}


def test_unwritable_store_is_a_clear_error(tmp_path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SnapshotError, match="cannot open snapshot store"):
        SnapshotStore(f / "db")


def test_snapshot_cli_inspect_and_verify(tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from kvstream.replica.snapshot_cli import snapshot as snapshot_cmd

    logs, _ = random_log(9)
    fold = new_fold()
    feed(fold, logs)
    store, snap, gen = snapshot(tmp_path, fold)
    snap.close()
    store.close()
    runner = CliRunner()
    out = runner.invoke(snapshot_cmd, ["inspect", str(tmp_path / "snap"), "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["generation"] == gen and doc["next_offsets"] == {str(p): len(r) for p, r in logs.items()}
    assert doc["workers"] == len(fold.workers)
    out = runner.invoke(snapshot_cmd, ["verify", str(tmp_path / "snap")])
    assert out.exit_code == 0 and "ok" in out.output
    store = SnapshotStore(tmp_path / "snap")
    _damage(store, b"w")
    store.close()
    out = runner.invoke(snapshot_cmd, ["verify", str(tmp_path / "snap")])
    assert out.exit_code == 1 and "BROKEN" in out.output
    out = runner.invoke(snapshot_cmd, ["inspect", str(tmp_path / "snap")])
    assert out.exit_code == 1 and "no valid snapshot" in out.output


def test_read_only_open_beside_a_writer(tmp_path) -> None:
    logs, _ = random_log(13)
    fold = new_fold()
    feed(fold, logs)
    store, snap, gen = snapshot(tmp_path, fold)
    reader = SnapshotStore(tmp_path / "snap", read_only=True)  # the writer still holds it
    try:
        loaded, _ = reader.load_latest()
        assert loaded is not None and loaded[0].gen == gen
    finally:
        reader.close()
        snap.close()
        store.close()
    with pytest.raises(SnapshotError):
        SnapshotStore(tmp_path / "missing", read_only=True)
