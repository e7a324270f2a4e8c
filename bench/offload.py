"""``kvstream bench offload``: GB/s through the tiered pool's offload engine and onboarding,
each next to a raw baseline of the same bytes measured in the same run.

- g1_to_g2: registering blocks on G1 until the engine has them on G2, against one torch
  copy of the same bytes from the G1 tensor into the G2 tensor.
- g2_to_g3: blocks reaching the disk filter until the engine has them on G3 (plus
  fdatasync), against one sequential write of the same bytes to a preallocated file (plus
  fdatasync).
- g3_to_g1: onboarding blocks held only on G3 (G3 → host staging → G1), against one
  sequential read of the same bytes into host memory plus one torch copy into G1.

Disk figures depend on the page cache: unless ``--keep-page-cache``, both files are
synced and their pages dropped (POSIX_FADV_DONTNEED, advisory) before each read, and the
JSON reports the fraction of each file that was still resident (mincore) right before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np

from kvstream.events.model import Tier
from kvstream.hashing import block_hashes
from bench.common import emit, json_option

_GB = 1e9
_TARGET = 0.8


def _resident_fraction(path: Path) -> float | None:
    """Fraction of the file's pages in the page cache (mincore), None where unavailable."""
    size = path.stat().st_size
    if size == 0:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = np.zeros(pages, dtype=np.uint8)
            view = np.frombuffer(mm, dtype=np.uint8)
            rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), ctypes.c_void_p(vec.ctypes.data))
            del view
            if rc != 0:
                return None
            return round(float((vec & 1).mean()), 4)
    except (OSError, AttributeError, ValueError):
        return None


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (tiny quick runs give tiny figures)."""
    return float(f"{x:.4g}")


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise click.ClickException(f"offload benchmark: {what}")


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _path_result(nbytes: int, engine_s: list[float], baseline_s: list[float], **extra: Any) -> dict[str, Any]:
    gbps = nbytes / min(engine_s) / _GB
    base = nbytes / min(baseline_s) / _GB
    return {
        "gbps": _sig(gbps),
        "baseline_gbps": _sig(base),
        "ratio": _sig(gbps / base),
        "meets_target": gbps / base >= _TARGET,
        **extra,
    }


@click.command("offload")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--blocks", type=int, default=None, help="Blocks moved per path [default: 64 on cpu, 1024 on cuda].")
@click.option("--block-mib", type=float, default=2.0, show_default=True, help="Block size (layers of 16 tokens × 8 heads × 128 dims, fp16).")
@click.option("--batch", "batch_blocks", type=int, default=16, show_default=True, help="Blocks per copy.")
@click.option("--disk-threads", type=int, default=2, show_default=True)
@click.option("--rounds", type=int, default=3, show_default=True, help="Best of this many rounds (engine and baseline alike).")
@click.option("--dir", "work_dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Where the G3 and baseline files go [default: system temp].")
@click.option("--keep-page-cache", is_flag=True, help="Do not drop the files' pages before reads.")
@json_option
def offload_bench(
    device: str,
    blocks: int | None,
    block_mib: float,
    batch_blocks: int,
    disk_threads: int,
    rounds: int,
    work_dir: Path | None,
    keep_page_cache: bool,
    as_json: bool,
) -> None:
    """G1→G2, G2→G3 and G3→G2→G1 throughput through the engine, against raw copies."""
    try:
        import torch
    except ImportError:
        raise click.ClickException("the offload benchmark needs torch (pip install 'kvstream[worker]')") from None
    from kvstream.worker.errors import DiskTierError, LayoutError, PoolConfigError
    from kvstream.worker.layout import BlockLayout
    from kvstream.worker.offload import OffloadEngine, OffloadOptions
    from kvstream.worker.onboard import Onboarder
    from kvstream.worker.pool import NewBlock, PoolOptions, TieredBlockPool

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise click.ClickException("--device cuda: CUDA is not available here")
    n = blocks if blocks is not None else (1024 if device == "cuda" else 64)
    if n <= 0 or rounds <= 0 or block_mib <= 0:
        raise click.ClickException("--blocks, --rounds and --block-mib must be positive")
    layer_bytes = 2 * 16 * 8 * 128 * 2
    layers = max(1, round(block_mib * 2**20 / layer_bytes))
    layout = BlockLayout(num_layers=layers, block_size=16, kv_heads=8, head_dim=128, dtype=torch.float16)
    nbytes = n * layout.block_bytes
    cuda = device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    class _NullSink:
        def on_source_event(self, event: object) -> None:
            pass

    tmp = tempfile.TemporaryDirectory(dir=work_dir, prefix="kvstream-bench-offload-")
    base_dir = Path(tmp.name)
    g3_path = base_dir / "g3.blocks"
    base_path = base_dir / "baseline.blocks"
    options = PoolOptions(host_capacity=n, disk_capacity=n, disk_path=g3_path)
    try:
        # Two sightings before G3, so that g1_to_g2 and g2_to_g3 are timed apart.
        offload_options = OffloadOptions(batch_blocks=batch_blocks, disk_threads=disk_threads, disk_min_seen=2)
        pool = TieredBlockPool.create(layout, n, options, _NullSink(), device=device)
    except (PoolConfigError, LayoutError, DiskTierError) as exc:
        tmp.cleanup()
        raise click.ClickException(str(exc)) from None
    engine = OffloadEngine(pool, offload_options)
    try:
        pool.device_store.data.view(torch.uint8).random_(0, 256)  # type: ignore[attr-defined]
        g1_data = pool.device_store.data  # type: ignore[attr-defined]
        host = pool.host_store
        host_bytes = memoryview(host.byte_rows().numpy()).cast("B")
        with open(base_path, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, nbytes)

        def round_hashes(r: int) -> tuple[list[int], list[int]]:
            # fresh hashes every round: the disk filter sees each block once in g1_to_g2
            return block_hashes(list(range(r * n * 16, (r + 1) * n * 16)), 16)

        def g1_to_g2(local: list[int], seq: list[int]) -> None:
            slots = pool.device.allocate(n)
            blocks = [NewBlock(s, seq[i], seq[i - 1] if i else None, local[i]) for i, s in enumerate(slots)]
            pool.device.register(blocks, pin=False)
            engine.wait_idle()

        def g2_to_g3(seq: list[int]) -> None:
            pool.device.pin(seq, hit=True)  # the second sighting: through the disk filter
            pool.device.unpin(seq)
            engine.wait_idle()
            _check(pool.disk_store is not None, "no G3 tier")
            pool.disk_store.sync()  # type: ignore[union-attr]

        def baseline_write() -> None:
            fd = os.open(base_path, os.O_WRONLY)
            try:
                done = 0
                while done < nbytes:
                    done += os.pwrite(fd, host_bytes[done:], done)
                os.fdatasync(fd)
            finally:
                os.close(fd)

        def baseline_read() -> None:
            with open(base_path, "rb", buffering=0) as f:
                done = 0
                while done < nbytes:
                    got = f.readinto(host_bytes[done:])
                    if not got:
                        raise click.ClickException("baseline file shorter than expected")
                    done += got

        t12: list[float] = []
        b12: list[float] = []
        t23: list[float] = []
        b23: list[float] = []
        seqs: list[list[int]] = []
        for r in range(rounds):
            local, seq = round_hashes(r)
            b12.append(_timed(lambda: (host.data.copy_(g1_data), sync())))
            pool.host.remove(pool.host.hashes())
            t12.append(_timed(lambda: g1_to_g2(local, seq)))
            _check(pool.host.match(seq) == n, "not every block reached G2")
            b23.append(_timed(baseline_write))
            disk = pool.tier(Tier.DISK)
            disk.remove(disk.hashes())
            t23.append(_timed(lambda: g2_to_g3(seq)))
            _check(disk.match(seq) == n, "not every block reached G3")
            seqs.append(seq)
        stats = engine.close().stats  # g3_to_g1 measures onboarding alone

        onboarder = Onboarder(pool, batch_blocks=batch_blocks)
        seq = seqs[-1]
        t31: list[float] = []
        b31: list[float] = []
        b31_read: list[float] = []
        resident: dict[str, list[float | None]] = {"engine": [], "baseline": []}
        for _ in range(rounds):
            pool.device.remove([h for h in seq if h in pool.device])
            pool.host.remove(pool.host.hashes())
            if not keep_page_cache:
                _drop_cache(base_path)
            resident["baseline"].append(_resident_fraction(base_path))
            read_s = _timed(baseline_read)
            copy_s = _timed(lambda: (g1_data.copy_(host.data, non_blocking=True), sync()))
            b31_read.append(read_s)
            b31.append(read_s + copy_s)
            if not keep_page_cache:
                _drop_cache(g3_path)
            resident["engine"].append(_resident_fraction(g3_path))
            result = None

            def onboard() -> None:
                nonlocal result
                result = onboarder.onboard(seq)

            t31.append(_timed(onboard))
            _check(result is not None and result.disk_blocks == n, "not every block came back from G3")
            pool.device.unpin(seq)
    finally:
        if not engine.closed:
            engine.close(drain=False)
        pool.close()
        tmp.cleanup()

    page_cache = {
        "dropped_before_reads": not keep_page_cache,
        "method": "fdatasync + posix_fadvise(DONTNEED), advisory" if not keep_page_cache else "none",
        "resident_fraction_before_read": resident,
        "writes": "timed through fdatasync (engine: G3 file; baseline: its file)",
    }
    emit(
        {
            "bench": "offload",
            "device": device,
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "host_pinned": host.pinned,
            "blocks": n,
            "block_bytes": layout.block_bytes,
            "batch_blocks": batch_blocks,
            "disk_threads": disk_threads,
            "rounds": rounds,
            "bytes_per_path": nbytes,
            "target_ratio": _TARGET,
            "paths": {
                "g1_to_g2": _path_result(nbytes, t12, b12, baseline="one torch copy G1 tensor → G2 tensor"),
                "g2_to_g3": _path_result(nbytes, t23, b23, baseline="one sequential pwrite + fdatasync"),
                "g3_to_g1": _path_result(
                    nbytes,
                    t31,
                    b31,
                    baseline="one sequential read + one torch copy into G1",
                    baseline_read_only_gbps=_sig(nbytes / min(b31_read) / _GB),
                ),
            },
            "page_cache": page_cache,
            "engine": {
                "written_host": stats.written_host,
                "written_disk": stats.written_disk,
                "skipped_present": stats.skipped_present,
                "skipped_no_space": stats.skipped_no_space,
                "failed": stats.failed,
            },
        },
        as_json,
    )
