"""The pieces of ``kvstream replay`` that need no broker: times, offsets, filters, the
diff of two states, prompt files."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from kvstream.events.model import Tier
from kvstream.tools.replay.diff import Difference, IndexState, diff_states, state_of_fold
from kvstream.tools.replay.dump import EventFilter, json_row, record_rows
from kvstream.tools.replay.errors import ReplayError, SourceError
from kvstream.tools.replay.explain import load_request
from kvstream.replica.record import Record
from kvstream.tools.replay.reader import format_time, parse_offsets, parse_time

from tests.replica.helpers import CODEC, FakeWorkerLog, new_fold

NOW = datetime(2026, 11, 29, 10, 0, 0, tzinfo=timezone.utc)
NOW_MS = 1795946400000


def test_parse_time_forms() -> None:
    assert int(NOW.timestamp() * 1000) == NOW_MS
    assert parse_time("2026-11-29T10:00:00Z") == NOW_MS
    assert parse_time("2026-11-29T10:00:00") == NOW_MS  # no zone: UTC
    assert parse_time("2026-11-29T11:00:00+01:00") == NOW_MS
    assert parse_time("@123") == 123
    assert parse_time("now", NOW) == NOW_MS
    assert parse_time("-10m", NOW) == NOW_MS - 600_000
    assert parse_time("-1.5h", NOW) == NOW_MS - 5_400_000
    assert parse_time(format_time(NOW_MS + 7)) == NOW_MS + 7
    with pytest.raises(ReplayError, match="cannot read time"):
        parse_time("yesterday")


def test_parse_offsets() -> None:
    assert parse_offsets(()) is None
    assert parse_offsets(("5", "2:9")) == {None: 5, 2: 9}
    for bad in ("x", "1:y", "-3"):
        with pytest.raises(ReplayError):
            parse_offsets((bad,))


def _rows(value: bytes | None, tick: bool = False) -> list[dict]:
    return record_rows(Record(0, 7, NOW_MS, None, value, tick), CODEC.decode)


def test_jsonl_rows_carry_64_bit_values_as_strings() -> None:
    """A double holds integers exactly only up to 2^53: 2^53 + 1 and u64 max survive
    a JSON reader that parses numbers as doubles only as strings."""
    big = (1 << 53) + 1
    w = FakeWorkerLog(2**64 - 1, epoch=big)
    w.next_id[0] = big
    ev = w.removed(list(range(32)))
    (row,) = _rows(w.batch(ev))
    line = json.dumps(json_row(row))
    as_doubles = json.loads(line, parse_int=float, parse_float=float)  # a double-only reader
    assert as_doubles["worker_id"] == "18446744073709551615" and as_doubles["epoch"] == str(big)
    assert as_doubles["event_id"] == str(big) and as_doubles["lease_ms"] == str(w.lease_ms)
    assert [int(h) for h in as_doubles["block_hashes"]] == list(ev.block_hashes)
    assert as_doubles["parent_hash"] is None and as_doubles["dp_rank"] == 0.0
    numbers = json.loads(json.dumps(json_row(row, wide_as_numbers=True)))
    assert numbers["worker_id"] == 2**64 - 1 and numbers["event_id"] == big
    assert json.loads(json.dumps(json_row(row, True)), parse_int=float)["event_id"] != big  # what strings avoid


def test_rows_and_filters() -> None:
    w = FakeWorkerLog(3, ranks=2)
    toks = list(range(48))
    stored = w.stored(toks, rank=1, tier=Tier.DISK)
    rows = _rows(w.batch(w.cleared(0), stored))
    assert [(r["kind"], r["dp_rank"], r["tier"]) for r in rows] == [("cleared", 0, "device"), ("stored", 1, "disk")]
    assert rows[1]["block_hashes"] == list(stored.block_hashes)
    assert rows[1]["tokens_hashes"] == list(stored.tokens_hashes)
    assert [r["kind"] for r in _rows(w.batch())] == ["heartbeat"]
    assert [r["kind"] for r in _rows(None, tick=True)] == ["tick"]
    bad = _rows(b"\x00garbage")
    assert bad[0]["kind"] == "undecodable" and bad[0]["error"]

    def keep(f: EventFilter) -> list[str]:
        return [r["kind"] for r in rows + bad if f.matches(r)]

    assert keep(EventFilter()) == ["cleared", "stored", "undecodable"]
    assert keep(EventFilter(workers=frozenset({3}))) == ["cleared", "stored"]
    assert keep(EventFilter(workers=frozenset({4}))) == []
    assert keep(EventFilter(ranks=frozenset({1}))) == ["stored"]
    assert keep(EventFilter(tiers=frozenset({Tier.DEVICE}))) == ["cleared"]
    assert keep(EventFilter(kinds=frozenset({"undecodable"}))) == ["undecodable"]
    assert keep(EventFilter(block_hash=stored.tokens_hashes[2])) == ["stored"]
    assert keep(EventFilter(block_hash=12345)) == []


def test_diff_of_states_block_by_block_and_by_counts() -> None:
    w = FakeWorkerLog(1)
    toks = list(range(64))
    a, b = new_fold(), new_fold()
    a.apply_record(0, 0, 1, w.batch(w.cleared(), w.stored(toks)))
    same = FakeWorkerLog(1)
    b.apply_record(0, 0, 1, same.batch(same.cleared(), same.stored(toks)))
    sa, sb = state_of_fold(a, "a"), state_of_fold(b, "b")
    assert diff_states(sa, sb) == []
    rm = w.removed(toks, start_block=3)
    a.apply_record(0, 1, 2, w.batch(rm))
    sa = state_of_fold(a, "a")
    assert diff_states(sa, sb) == [Difference((1, 0, "device"), 3, 4, (), rm.block_hashes)]
    live = IndexState("live", {(1, 0, "device"): 4}, None)
    assert diff_states(sb, live) == []
    assert diff_states(sa, live) == [Difference((1, 0, "device"), 3, 4)]


def test_load_request_forms(tmp_path: Path) -> None:
    f = tmp_path / "p"
    f.write_text(json.dumps({"token_ids": [1, 2, 3], "request_id": "r", "weights": {"allowed_workers": [4]}}))
    req = load_request(f)
    assert req.token_ids == [1, 2, 3] and req.request_id == "r"
    f.write_text("[5, 6]")
    assert load_request(f).token_ids == [5, 6]
    f.write_text("7 8,9\n")
    assert load_request(f).token_ids == [7, 8, 9]
    for bad, why in (("[-1]", r"Expected `int` >= 0 at \$.token_ids\[0\]"), ("seven", "neither JSON"), ('{"tokens": [1]}', "unknown field `tokens`")):
        f.write_text(bad)
        with pytest.raises(SourceError, match=why):
            load_request(f)
    with pytest.raises(SourceError, match="cannot read"):
        load_request(tmp_path / "absent")
