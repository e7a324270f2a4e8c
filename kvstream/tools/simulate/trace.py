"""Requests of a trace in the Mooncake JSONL format (/work/shared/traces/README.md).

One JSON object a line: ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids``, one id per ``tokens_per_id`` tokens of the prompt (512 in the Mooncake
traces). Alibaba's Bailian (Qwen) traces use 16 tokens per id, stamp requests in
seconds (a float) and add ``chat_id``, ``parent_chat_id`` and ``turn`` (checked,
otherwise unused): a line with a ``chat_id`` is read as one of theirs. Tokens follow the
common replay convention: block ``j`` is the token ``hash_ids[j]`` (a u32) repeated
``tokens_per_id`` times, cut to ``input_length``; the engine then splits them into its
own blocks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstream.tools.simulate.errors import TraceError

MOONCAKE_TOKENS_PER_ID = 512
#: Fields of Alibaba's Bailian traces and their least value (-1: a session's first turn).
_BAILIAN_FIELDS = {"chat_id": 0, "parent_chat_id": -1, "turn": 0}
_U32 = 1 << 32


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload, in trace form (tokens are expanded on demand: a
    whole trace of expanded prompts would not fit in memory)."""

    request_id: str
    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tokens_per_id: int = MOONCAKE_TOKENS_PER_ID

    def tokens(self) -> list[int]:
        """The prompt's token ids (the replay convention above)."""
        out: list[int] = []
        for h in self.hash_ids:
            out.extend([h] * self.tokens_per_id)
            if len(out) >= self.input_length:
                break
        return out[: self.input_length]


@dataclass(frozen=True, slots=True)
class TraceOptions:
    #: Time scaling: arrival times are divided by ``speed`` (2.0 replays twice as fast).
    speed: float = 1.0
    #: Read at most this many requests (None: all).
    limit: int | None = None
    #: Prompt tokens each hash id stands for: a line must have exactly the ids that
    #: cover its input_length at this granularity.
    tokens_per_id: int = MOONCAKE_TOKENS_PER_ID

    def __post_init__(self) -> None:
        if self.tokens_per_id <= 0:
            raise TraceError(f"tokens_per_id must be positive, got {self.tokens_per_id}")
        if not self.speed > 0:
            raise TraceError(f"speed must be > 0, got {self.speed}")
        if self.limit is not None and self.limit <= 0:
            raise TraceError(f"limit must be positive, got {self.limit}")


def _field_int(record: dict[str, object], name: str, where: str) -> int:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"{where}: {name!r} must be an integer >= 0, got {value!r}")
    return value


def _arrival_ms(record: dict[str, object], where: str) -> float:
    if "chat_id" not in record:
        return _field_int(record, "timestamp", where)
    value = record.get("timestamp")  # Bailian: seconds
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise TraceError(f"{where}: 'timestamp' must be a number of seconds >= 0, got {value!r}")
    return value * 1000.0


def read_mooncake(path: str | Path, options: TraceOptions | None = None) -> list[Request]:
    """The requests of a Mooncake trace, in arrival order (validated: a bad line is an
    error naming the line, never skipped)."""
    options = options or TraceOptions()
    return list(_iter_mooncake(Path(path), options))


def _iter_mooncake(path: Path, options: TraceOptions) -> Iterator[Request]:
    try:
        handle = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    with handle:
        n = 0
        last_ts = -1
        for lineno, line in enumerate(handle, 1):
            if options.limit is not None and n >= options.limit:
                return
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise TraceError(f"{where}: a line must be a JSON object")
            ts = _arrival_ms(record, where)
            if ts < last_ts:
                raise TraceError(f"{where}: timestamp {ts} goes back in time (previous {last_ts})")
            last_ts = ts
            isl = _field_int(record, "input_length", where)
            osl = _field_int(record, "output_length", where)
            ids = record.get("hash_ids")
            if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and 0 <= h < _U32 for h in ids
            ):
                raise TraceError(f"{where}: 'hash_ids' must be a list of u32 integers")
            tpi = options.tokens_per_id
            need = -(-isl // tpi)
            if len(ids) != need:
                # Too few would leave the prompt short; too many means the ids stand for
                # fewer tokens than assumed, and the prompt would be misread silently.
                raise TraceError(
                    f"{where}: {len(ids)} hash ids, but input_length {isl} at {tpi} tokens per id "
                    f"needs {need} (ids of another granularity need --tokens-per-id)"
                )
            for name, low in _BAILIAN_FIELDS.items():
                value = record.get(name)
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                    raise TraceError(f"{where}: {name!r} must be an integer >= {low}, got {value!r}")
            yield Request(f"r{n}", ts / options.speed, isl, max(osl, 1), tuple(ids), tpi)
            n += 1
