"""The state an engine bridge keeps across its own restarts (DESIGN.md §3), in a local
RocksDB: the consolidated blocks, the converter's memory, the next engine sequence
number of each endpoint, and where the publisher's epoch stands.

A checkpoint is written only after the publisher's flush was acknowledged, so that it
never runs ahead of the log. ``clean`` says that nothing was published after it (a
stop, not a crash): the next start then resumes the same epoch with the next event
ids; otherwise events published after the checkpoint may be on the log, and the next
start republishes the whole state under a new epoch. Either way the engines' replay
buffers supply what they published meanwhile.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from kvstream.worker.errors import BridgeStateError
from kvstream.worker.publisher import ResumePoint

_FORMAT = 1
_META = b"meta"
_RANK = b"rank/"
_CONVERTER = b"converter"


@dataclass(frozen=True, slots=True)
class BridgeCheckpoint:
    worker_id: int
    mode: str
    #: Where the publisher stood once everything before was acknowledged.
    resume: ResumePoint
    #: Endpoint → (next engine sequence number, digest of the last payload, its ranks).
    positions: Mapping[str, tuple[int, int, list[int]]]
    #: True when the process stopped right after writing it.
    clean: bool
    #: Consolidator state per rank (Consolidator.dump_state).
    ranks: Mapping[int, bytes]
    converter: bytes | None


class BridgeStateStore:
    def __init__(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        try:
            self._db = Rdict(str(path), Options(raw_mode=True))
        except Exception as exc:  # rocksdict raises plain Exceptions (locks, corruption)
            raise BridgeStateError(f"cannot open bridge state in {path}: {exc}") from None
        self.path = path
        self._sync = WriteOptions()
        self._sync.sync = True

    def load(self, worker_id: int, mode: str) -> BridgeCheckpoint | None:
        """The last checkpoint (None: none yet). A checkpoint of another worker or mode
        is refused: its blocks would be published under the wrong identity."""
        raw = self._db.get(_META)
        if raw is None:
            return None
        try:
            meta = json.loads(raw)
            if meta["format"] != _FORMAT:
                raise BridgeStateError(f"bridge state in {self.path} has format {meta['format']}, expected {_FORMAT}")
            if meta["worker_id"] != worker_id or meta["mode"] != mode:
                raise BridgeStateError(
                    f"bridge state in {self.path} belongs to worker {meta['worker_id']} ({meta['mode']}), "
                    f"not worker {worker_id} ({mode}): use another --state-dir"
                )
            ranks: dict[int, bytes] = {}
            for k, v in self._db.items(from_key=_RANK):
                if not k.startswith(_RANK):
                    break
                ranks[int(k[len(_RANK) :])] = v
            return BridgeCheckpoint(
                worker_id=worker_id,
                mode=mode,
                resume=ResumePoint(meta["epoch"], {int(r): i for r, i in meta["next_ids"].items()}),
                positions=meta["positions"],
                clean=meta["clean"],
                ranks=ranks,
                converter=self._db.get(_CONVERTER),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise BridgeStateError(f"bridge state in {self.path} is unreadable: {exc!r}") from None

    def save(self, cp: BridgeCheckpoint) -> None:
        """Replace the checkpoint, atomically (one write batch)."""
        meta = {
            "format": _FORMAT,
            "worker_id": cp.worker_id,
            "mode": cp.mode,
            "epoch": cp.resume.epoch,
            "next_ids": {str(r): i for r, i in cp.resume.next_ids.items()},
            "positions": dict(cp.positions),
            "clean": cp.clean,
        }
        wb = WriteBatch(raw_mode=True)
        for k in self._db.keys(from_key=_RANK):
            if not k.startswith(_RANK):
                break
            wb.delete(k)
        for rank, data in cp.ranks.items():
            wb.put(_RANK + str(rank).encode(), data)
        if cp.converter is not None:
            wb.put(_CONVERTER, cp.converter)
        wb.put(_META, json.dumps(meta).encode())
        self._db.write(wb, self._sync)

    def mark_unclean(self) -> None:
        """From now on the log may run ahead of the checkpoint."""
        raw = self._db.get(_META)
        if raw is not None:
            meta = json.loads(raw)
            meta["clean"] = False
            wb = WriteBatch(raw_mode=True)
            wb.put(_META, json.dumps(meta).encode())
            self._db.write(wb, self._sync)

    def close(self) -> None:
        self._db.close()
