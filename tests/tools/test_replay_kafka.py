"""``kvstream replay`` against the real broker (issue 7's done-when list)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from click.testing import CliRunner, Result
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from kvstream.events.model import Tier
from kvstream.hashing import block_hashes
from kvstream.kafka.config import admin_config
from kvstream.replica.service import create_app
from kvstream.router.explain import decision_dict
from kvstream.settings import Settings
from kvstream.tools.replay.cli import replay
from kvstream.tools.replay.reader import format_time
from kvstream.tools.replay.rebuild import rebuild_at
from kvstream.worker.announce import register_synthetic

from tests.replica.helpers import FakeWorkerLog
from tests.replica.test_replica_kafka import high_watermarks, log_records, produce, start, wait_caught_up
from tests.replica.test_snapshot import matches, state

pytestmark = pytest.mark.kafka

#: Leases far longer than a test: no worker expires while the test runs.
LEASE = 10**9


def run(settings: Settings, *args: str) -> Result:
    common = ["--bootstrap", settings.bootstrap or "", "--topic-prefix", settings.topics.prefix, "--no-progress"]
    return CliRunner().invoke(replay, [args[0], *common, *args[1:]], catch_exceptions=False)


def out_json(res: Result) -> dict:
    """The command's JSON object (its last stdout line: library log lines may precede it
    here, where nothing configured logging to stderr as ``kvstream`` does)."""
    return json.loads(res.stdout.splitlines()[-1])


def now_ms() -> int:
    return int(time.time() * 1000)


def settle(replica, settings: Settings) -> None:
    """Caught up, including the ticks the replica published when it started."""
    wait_caught_up(replica, settings)
    time.sleep(0.3)
    wait_caught_up(replica, settings)


def by_worker(d: dict) -> dict:
    """A decision with its candidates keyed by worker: their order is the order in which
    the replica first saw each worker, which depends on how partitions interleaved."""
    return {**d, "candidates": sorted(d["candidates"], key=lambda c: (c["worker_id"], c["dp_rank"]))}


# -- rebuild -----------------------------------------------------------------------------


def test_rebuild_at_t_equals_replica_stopped_at_t(kafka_topics: Settings, tmp_path: Path) -> None:
    records, prefixes = log_records(21)
    third = len(records) // 3
    produce(kafka_topics, records[:third])
    early = start(kafka_topics, snapshot_dir=tmp_path / "snap")
    settle(early, kafka_topics)
    early.stop()  # final snapshot: a fold of the first third (and the ticks)
    produce(kafka_topics, records[third : 2 * third])
    r = start(kafka_topics)
    settle(r, kafka_topics)
    r.stop()
    expected = state(r.fold)
    expected_matches = matches(r.fold, prefixes)
    time.sleep(0.05)
    t = now_ms()
    time.sleep(0.05)
    produce(kafka_topics, records[2 * third :])

    from_start = rebuild_at(kafka_topics, t)
    assert from_start.source == "start of the log"
    assert state(from_start.fold) == expected
    assert matches(from_start.fold, prefixes) == expected_matches
    assert expected[0], "the log indexed nothing"

    from_snap = rebuild_at(kafka_topics, t, tmp_path / "snap")
    assert from_snap.source.startswith("snapshot generation")
    assert state(from_snap.fold)[0] == expected[0]
    assert matches(from_snap.fold, prefixes) == expected_matches
    assert from_snap.records < from_start.records

    # A time before the snapshot: the snapshot is past it, so the log is read from 0.
    res = run(kafka_topics, "rebuild", "--at", "@1", "--snapshot-dir", str(tmp_path / "snap"), "--json")
    assert res.exit_code == 0, res.output
    doc = out_json(res)
    assert doc["source"] == "start of the log" and doc["workers"] == []
    assert "past the asked time" in res.stderr

    # The CLI's summary, and the snapshot it writes restores to the same state.
    res = run(kafka_topics, "rebuild", "--at", format_time(t), "--json", "--write-snapshot", str(tmp_path / "out"))
    assert res.exit_code == 0, res.output
    doc = out_json(res)
    sizes = {(k.worker_id, k.dp_rank): v for k, v in r.router.tree_sizes().items()}
    assert {(w["worker_id"], w["dp_rank"]): {tier: w[tier.value] for tier in Tier} for w in doc["workers"]} == sizes
    assert doc["snapshot_generation"] == 1
    res = run(kafka_topics, "diff", str(tmp_path / "out"), format_time(t))
    assert res.exit_code == 0, res.output


# -- explain -----------------------------------------------------------------------------


def test_explain_equals_live_decisions(kafka_topics: Settings, tmp_path: Path) -> None:
    a = list(range(1000, 1000 + 16 * 4))  # 4 blocks
    w1, w2, w3 = FakeWorkerLog(1, lease_ms=LEASE), FakeWorkerLog(2, lease_ms=LEASE), FakeWorkerLog(3, lease_ms=LEASE)
    produce(
        kafka_topics,
        [
            (1, w1.batch(w1.cleared(), w1.stored(a))),
            # worker 2: the first 2 blocks on the GPU, the next 2 on host memory
            (2, w2.batch(w2.cleared(), w2.stored(a[:32]), w2.stored(a, tier=Tier.HOST_PINNED))),
            (3, w3.batch(w3.cleared(), w3.stored(list(range(64))))),
        ],
    )
    replica = start(kafka_topics)
    try:
        settle(replica, kafka_topics)
        prompt = a + list(range(7, 7 + 16))  # 5 blocks, 4 of them cached somewhere
        live = []
        for rid in ("req-1", "req-2", "req-3"):
            live.append(decision_dict(replica.route(prompt, request_id=rid), explain=True))
            time.sleep(0.01)
        # Worker 1 holds 4 of the 5 blocks; once req-1 is routed there, its fifth is
        # expected there too (predicted, not stored), which explain shows apart.
        assert live[0]["worker_id"] == 1
        one = next(c for c in live[1]["candidates"] if c["worker_id"] == 1)
        assert (one["overlap"]["device"], one["overlap"]["expected"], one["active_requests"]) == (4, 1, 1)
        replica.free("req-3")
        time.sleep(0.01)
        t = now_ms()
        time.sleep(0.01)
        query = decision_dict(replica.route(prompt, request_id="probe", query_only=True), explain=True)
        replica.free("req-1")  # after t: must not count
    finally:
        replica.stop()

    for rid, expected in zip(("req-1", "req-2", "req-3"), live):
        res = run(kafka_topics, "explain", "--request-id", rid)
        assert res.exit_code == 0, res.output
        assert by_worker(out_json(res)) == by_worker(expected)

    body = tmp_path / "request.json"
    body.write_text(json.dumps({"token_ids": prompt, "request_id": "probe", "explain": True}))
    res = run(kafka_topics, "explain", "--at", format_time(t), "--tokens-file", str(body))
    assert res.exit_code == 0, res.output
    assert by_worker(out_json(res)) == by_worker(query)
    assert query["worker_id"] == 1  # req-1 and req-2 run at t; the free of req-1 came later

    res = run(kafka_topics, "explain", "--request-id", "never-routed")
    assert res.exit_code == 2 and "not in the active topic" in res.stderr
    assert "Traceback" not in res.output


def test_explain_agrees_with_live_after_a_worker_expired_and_came_back(kafka_topics: Settings) -> None:
    """Issue 25: k1 on worker 20, never freed; 20's lease expires (the live router drops
    its requests) and 20 comes back; k2 is explained with the load it had live."""
    a = list(range(3000, 3000 + 16 * 4))
    w20, w21 = FakeWorkerLog(20, lease_ms=1500), FakeWorkerLog(21, lease_ms=LEASE)
    produce(kafka_topics, [(20, w20.batch(w20.cleared(), w20.stored(a))), (21, w21.batch(w21.cleared(), w21.stored(a[:32])))])
    replica = start(kafka_topics, tick_interval_s=0.2)

    def known(wid: int) -> bool:
        with replica.lock:
            return wid in replica.fold.workers

    def wait(cond) -> None:
        deadline = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < deadline
            time.sleep(0.05)

    try:
        settle(replica, kafka_topics)
        assert replica.route(a, request_id="k1").worker.worker_id == 20
        wait(lambda: not known(20))  # the ticks moved the log time past its lease
        back = FakeWorkerLog(20, epoch=2, lease_ms=LEASE)
        produce(kafka_topics, [(20, back.batch(back.cleared(), back.stored(a)))])
        wait(lambda: known(20))
        time.sleep(0.01)
        k2 = decision_dict(replica.route(a, request_id="k2"), explain=True)
    finally:
        replica.stop()
    assert [c["active_requests"] for c in by_worker(k2)["candidates"]] == [0, 0]
    res = run(kafka_topics, "explain", "--request-id", "k2")
    assert res.exit_code == 0, res.output
    assert by_worker(out_json(res)) == by_worker(k2)


# -- diff --------------------------------------------------------------------------------


def test_diff_reports_exactly_the_injected_differences(kafka_topics: Settings, tmp_path: Path) -> None:
    toks = list(range(500, 500 + 16 * 6))
    _, seq = block_hashes(toks)
    w = FakeWorkerLog(9, lease_ms=LEASE)
    other = FakeWorkerLog(10, lease_ms=LEASE)
    produce(kafka_topics, [(9, w.batch(w.cleared(), w.stored(toks[:64]))), (10, other.batch(other.cleared(), other.stored(toks)))])
    first = start(kafka_topics, snapshot_dir=tmp_path / "a")
    settle(first, kafka_topics)
    first.stop()
    t_a = now_ms()
    time.sleep(0.05)
    # Injected: worker 9 gains 6 blocks on disk and loses block 3 from the GPU.
    produce(kafka_topics, [(9, w.batch(w.stored(toks, tier=Tier.DISK), w.removed(toks[:64], start_block=3)))])
    second = start(kafka_topics, snapshot_dir=tmp_path / "b")
    settle(second, kafka_topics)
    server = uvicorn.Server(uvicorn.Config(create_app(second), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        res = run(kafka_topics, "diff", str(tmp_path / "a"), url, "--json")
        assert res.exit_code == 1, res.output
        counts = {(d["worker_id"], d["tier"]): (d["count_a"], d["count_b"]) for d in out_json(res)["differences"]}
        assert counts == {(9, "device"): (4, 3), (9, "disk"): (0, 6)}
        res = run(kafka_topics, "diff", "now", url)
        assert res.exit_code == 0, res.output
    finally:
        server.should_exit = True
        thread.join(10)
        second.stop()

    res = run(kafka_topics, "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    assert res.exit_code == 1, res.output
    diffs = out_json(res)["differences"]
    assert diffs == [
        {"worker_id": 9, "dp_rank": 0, "tier": "device", "count_a": 4, "count_b": 3, "only_a": [seq[3]], "only_b": []},
        {"worker_id": 9, "dp_rank": 0, "tier": "disk", "count_a": 0, "count_b": 6, "only_a": [], "only_b": sorted(seq)},
    ]
    for a, b in ((str(tmp_path / "a"), format_time(t_a)), (str(tmp_path / "b"), "now"), (format_time(t_a), format_time(t_a))):
        res = run(kafka_topics, "diff", a, b)
        assert res.exit_code == 0, res.output
        assert "equal" in res.stdout
    res = run(kafka_topics, "diff", format_time(t_a), "now")
    assert res.exit_code == 1 and "only in B: 6" in res.stdout


# -- dump --------------------------------------------------------------------------------


def _rows(res: Result) -> list[dict]:
    assert res.exit_code == 0, res.output
    return [json.loads(line) for line in res.stdout.splitlines()]


def test_dump_filters_return_exactly_the_matching_events(kafka_topics: Settings) -> None:
    w1, w2 = FakeWorkerLog(1, lease_ms=LEASE), FakeWorkerLog(2, lease_ms=LEASE)
    p1, p2 = list(range(16 * 3)), list(range(100, 100 + 16 * 2))
    first = [
        (1, w1.batch(w1.cleared(), w1.stored(p1))),
        (2, w2.batch(w2.cleared(), w2.stored(p2, tier=Tier.HOST_PINNED))),
    ]
    second = [
        (1, w1.batch(w1.removed(p1, start_block=2))),
        (2, w2.batch()),  # heartbeat
        (2, b"not an event batch"),
    ]
    produce(kafka_topics, first)
    time.sleep(0.05)
    t = now_ms()
    time.sleep(0.05)
    produce(kafka_topics, second)
    _, seq1 = block_hashes(p1)

    def ids(rows: list[dict]) -> list[tuple]:
        # 64-bit values come as decimal strings (exact in any JSON reader).
        return sorted((int(r["worker_id"] or 0), r["kind"], -1 if r["event_id"] is None else int(r["event_id"])) for r in rows)

    everything = _rows(run(kafka_topics, "dump", "--jsonl"))
    assert ids(everything) == [
        (0, "undecodable", -1), (1, "cleared", 0), (1, "removed", 2), (1, "stored", 1),
        (2, "cleared", 0), (2, "heartbeat", -1), (2, "stored", 1),
    ]
    assert ids(_rows(run(kafka_topics, "dump", "--jsonl", "--worker", "1"))) == [
        (1, "cleared", 0), (1, "removed", 2), (1, "stored", 1)
    ]
    host = _rows(run(kafka_topics, "dump", "--jsonl", "--tier", "host_pinned"))
    assert ids(host) == [(2, "stored", 1)]
    assert host[0]["block_hashes"] == [str(h) for h in block_hashes(p2)[1]]
    numbers = _rows(run(kafka_topics, "dump", "--jsonl", "--u64-numbers", "--tier", "host_pinned"))
    assert numbers[0]["block_hashes"] == list(block_hashes(p2)[1]) and numbers[0]["worker_id"] == 2
    assert ids(_rows(run(kafka_topics, "dump", "--jsonl", "--kind", "removed", "--kind", "heartbeat"))) == [
        (1, "removed", 2), (2, "heartbeat", -1)
    ]
    # seq1[2] is stored (first batch) and removed (second batch); seq1[0] only stored.
    assert ids(_rows(run(kafka_topics, "dump", "--jsonl", "--block-hash", str(seq1[2])))) == [
        (1, "removed", 2), (1, "stored", 1)
    ]
    assert ids(_rows(run(kafka_topics, "dump", "--jsonl", "--block-hash", str(seq1[0])))) == [(1, "stored", 1)]
    assert ids(_rows(run(kafka_topics, "dump", "--jsonl", "--rank", "1"))) == []
    later = _rows(run(kafka_topics, "dump", "--jsonl", "--from", format_time(t)))
    assert sorted(r["kind"] for r in later) == ["heartbeat", "removed", "undecodable"]
    earlier = _rows(run(kafka_topics, "dump", "--jsonl", "--to", format_time(t)))
    assert ids(earlier) == [(1, "cleared", 0), (1, "stored", 1), (2, "cleared", 0), (2, "stored", 1)]
    # Offsets: exactly the record of the removal.
    removal = next(r for r in everything if r["kind"] == "removed")
    p, off = removal["partition"], removal["offset"]
    one = _rows(run(kafka_topics, "dump", "--jsonl", "--partition", str(p), "--from-offset", f"{p}:{off}", "--to-offset", f"{p}:{off}"))
    assert ids(one) == [(1, "removed", 2)]
    table = run(kafka_topics, "dump", "--worker", "2")
    assert table.exit_code == 0 and len(table.stdout.splitlines()) == 1 + 3  # header + rows


# -- stats -------------------------------------------------------------------------------


def test_stats_counts_kinds_rejections_and_gaps(kafka_topics: Settings) -> None:
    w = FakeWorkerLog(4, lease_ms=LEASE)
    toks = list(range(16 * 4))
    produce(kafka_topics, [(4, w.batch(w.cleared(), w.stored(toks[:32])))])
    t = now_ms()
    time.sleep(0.05)
    orphan = w.stored(toks, start_block=3)  # its parent, block 2, was never stored
    w.next_id[0] += 5  # a gap of 5 event ids
    produce(kafka_topics, [(4, w.batch(orphan, w.stored(toks, start_block=2)))])
    res = run(kafka_topics, "stats", "--json", "--from", format_time(t + 1))
    assert res.exit_code == 0, res.output
    doc = out_json(res)
    assert doc["records"] == 1
    assert doc["events_by_kind"] == {"stored": 2}
    assert doc["rejections"] == {"event_id_gap": 1, "stored_parent_not_found": 1}
    assert doc["issues_by_worker"] == {"4": {"event_id_gap": 1, "stored_parent_not_found": 1}}
    assert doc["largest_batches"][0]["events"] == 2
    whole = out_json(run(kafka_topics, "stats", "--json"))
    assert whole["events_by_kind"] == {"cleared": 1, "stored": 3}


# -- errors ------------------------------------------------------------------------------


def test_errors_are_one_message_and_exit_2(kafka_topics: Settings, kafka_topics_factory, tmp_path: Path) -> None:
    missing = kafka_topics_factory(create=False)
    res = run(missing, "dump")
    assert res.exit_code == 2 and "does not exist" in res.stderr and "Traceback" not in res.output

    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "CURRENT").write_text("garbage\n")
    res = run(kafka_topics, "rebuild", "--at", "now", "--snapshot-dir", str(tmp_path / "junk"))
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    res = run(kafka_topics, "diff", str(tmp_path / "nothing-here"), "now")
    assert res.exit_code == 2 and "neither a snapshot directory" in res.stderr

    w = FakeWorkerLog(6, lease_ms=LEASE)
    produce(kafka_topics, [(6, w.batch(w.cleared(), w.stored(list(range(32)))))])
    time.sleep(0.05)
    t = now_ms()
    time.sleep(0.05)
    produce(kafka_topics, [(6, w.batch(w.stored(list(range(64)), start_block=2)))])
    hw = high_watermarks(kafka_topics)
    admin = AdminClient(admin_config(kafka_topics))
    topic = kafka_topics.topics.name("events")
    parts = [TopicPartition(topic, p, n - 1) for p, n in hw.items() if n]
    for f in admin.delete_records(parts).values():
        f.result(timeout=30)
    for args in (("rebuild", "--at", format_time(t)), ("dump", "--from", format_time(t - 1000))):
        res = run(kafka_topics, *args)
        assert res.exit_code == 2, res.output
        assert "retention" in res.stderr and "Traceback" not in res.output


# -- follow and Ctrl-C -------------------------------------------------------------------


def test_follow_tails_the_live_log_and_stops_cleanly_on_ctrl_c(kafka_topics: Settings) -> None:
    w = FakeWorkerLog(8, lease_ms=LEASE)
    produce(kafka_topics, [(8, w.batch(w.cleared()))])
    env = {**os.environ, "KVSTREAM_BOOTSTRAP": kafka_topics.bootstrap or ""}
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("kvstream")), "replay", "dump", "--follow", "--jsonl",
         "--topic-prefix", kafka_topics.topics.prefix, "--worker", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert json.loads(proc.stdout.readline())["kind"] == "cleared"  # the existing record
        produce(kafka_topics, [(8, w.batch(w.stored(list(range(32)))))])
        row = json.loads(proc.stdout.readline())  # a record published after the start
        assert (row["kind"], row["event_id"]) == ("stored", "1")  # 64-bit values as strings
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in err


def test_explain_admits_the_workers_the_live_replica_admitted(kafka_topics: Settings, tmp_path: Path) -> None:
    """Phantoms (`cleared` only, never registered) are folded but never candidates: live
    and in replay, which folds kvstream.workers up to the decision's time; worker 3,
    which published before the decision and registered only after it, is a candidate
    of neither decision."""
    a = list(range(2000, 2000 + 16 * 3))
    w1, w2, w3 = FakeWorkerLog(1, lease_ms=LEASE), FakeWorkerLog(2, lease_ms=LEASE), FakeWorkerLog(3, lease_ms=LEASE)
    produce(kafka_topics, [(1, w1.batch(w1.cleared(), w1.stored(a))), (2, w2.batch(w2.cleared(), w2.stored(a[:16])))])
    phantoms = [FakeWorkerLog(wid, lease_ms=LEASE) for wid in range(900, 920)]
    produce(kafka_topics, [(p.worker_id, p.batch(p.cleared())) for p in [*phantoms, w3]], register=False)
    cold = list(range(50_000, 50_064))
    replica = start(kafka_topics)
    try:
        settle(replica, kafka_topics)
        live = decision_dict(replica.route(cold, request_id="cold"), explain=True)
        time.sleep(0.01)
        t = now_ms()
        time.sleep(0.01)
        register_synthetic(kafka_topics, [3])
        settle(replica, kafka_topics)
        with replica.lock:
            assert len(replica.fold.workers) == 23
        after = decision_dict(replica.route(cold, request_id="later", query_only=True), explain=True)
    finally:
        replica.stop()
    assert {c["worker_id"] for c in live["candidates"]} == {1, 2}
    assert {c["worker_id"] for c in after["candidates"]} == {1, 2, 3}  # registered now
    res = run(kafka_topics, "explain", "--request-id", "cold")
    assert res.exit_code == 0, res.output
    # The same candidates, scored alike (a cold prompt ties: the winner is drawn at random).
    assert by_worker(out_json(res))["candidates"] == by_worker(live)["candidates"]
    body = tmp_path / "request.json"
    body.write_text(json.dumps({"token_ids": cold, "explain": True}))
    res = run(kafka_topics, "explain", "--at", format_time(t), "--tokens-file", str(body))
    assert res.exit_code == 0, res.output
    assert {c["worker_id"] for c in out_json(res)["candidates"]} == {1, 2}
