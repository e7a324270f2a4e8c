"""``kvstream simulate``: trace input, generator, simulated engine, policies, reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstream.cli import cli
from kvstream.events.model import Tier
from kvstream.hashing import block_hashes
from kvstream.router import RouterConfig
from kvstream.tools.simulate.engine import CostModel, EngineConfig, Job, SimEngine
from kvstream.tools.simulate.errors import SimulationError, TraceError
from kvstream.tools.simulate.eventlog import EventLog, MemoryEventLog
from kvstream.tools.simulate.report import plot, summarize
from kvstream.tools.simulate.runner import SimClock, SimOptions, simulate
from kvstream.tools.simulate.trace import TraceOptions, read_mooncake
from kvstream.tools.simulate.workload import WorkloadOptions, generate
from kvstream.worker.consolidator import Consolidator, Mode

SMALL = EngineConfig(device_blocks=400, host_blocks=800, disk_blocks=1600)


def memory_log(config: RouterConfig, clock: SimClock, seed: int) -> EventLog:
    return MemoryEventLog(config, clock, seed)


def _write(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# -- trace ------------------------------------------------------------------------------


def test_mooncake_trace_is_read_with_speed_and_limit(tmp_path: Path) -> None:
    p = _write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]},
        {"timestamp": 1000, "input_length": 10, "output_length": 0, "hash_ids": [9]},
        {"timestamp": 2000, "input_length": 1, "output_length": 1, "hash_ids": [1]},
    ])
    reqs = read_mooncake(p, TraceOptions(speed=2.0, limit=2))
    assert [(r.arrival_ms, r.input_length, r.output_length) for r in reqs] == [(0, 600, 5), (500, 10, 1)]
    # The replay convention: each id is its own token, 512 times, cut to input_length.
    assert reqs[0].tokens() == [7] * 512 + [8] * 88
    assert reqs[1].tokens() == [9] * 10


def test_tokens_per_id_and_bailian_fields(tmp_path: Path) -> None:
    """Alibaba's Bailian (Qwen) traces: 16 tokens per id, sessions by chat ids."""
    p = _write(tmp_path / "qwen.jsonl", [
        {"chat_id": 0, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 40, "output_length": 3,
         "type": "text", "turn": 1, "hash_ids": [5, 6, 7]},
        {"chat_id": 1, "parent_chat_id": 0, "timestamp": 2.25, "input_length": 48, "output_length": 3,
         "type": "text", "turn": 2, "hash_ids": [5, 6, 8]},
    ])
    reqs = read_mooncake(p, TraceOptions(tokens_per_id=16))
    assert [r.arrival_ms for r in reqs] == [500.0, 2250.0]  # Bailian stamps in seconds
    assert reqs[0].tokens() == [5] * 16 + [6] * 16 + [7] * 8
    assert reqs[1].tokens()[:32] == reqs[0].tokens()[:32] and len(reqs[1].tokens()) == 48
    with pytest.raises(TraceError, match=r"qwen.jsonl:1: 3 hash ids, but input_length 40 at 512 tokens per id needs 1"):
        read_mooncake(p)  # the Mooncake default would misread it
    res = CliRunner().invoke(cli, ["simulate", "--trace", str(p), "--workers", "2", "--json", "--no-progress"])
    assert res.exit_code != 0 and "--tokens-per-id" in res.output
    res = CliRunner().invoke(cli, ["simulate", "--trace", str(p), "--tokens-per-id", "16", "--workers", "2", "--block-size", "8",
                                   "--device-tokens", "4000", "--json", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.splitlines()[-1])["requests"] == 2


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("not json", "not JSON"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "needs 2"),
        # 16 tokens per id (a Qwen trace) read at 512: ids beyond the prompt are refused.
        ('{"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": [1, 2, 3]}', "needs 1 .*--tokens-per-id"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "turn": "2"}', "'turn'"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "parent_chat_id": -2}', "parent_chat_id"),
        ('{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [-3]}', "u32"),
        ('[1, 2]', "JSON object"),
    ],
)
def test_bad_trace_lines_are_errors_naming_the_line(tmp_path: Path, line: str, reason: str) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=f"t.jsonl:2: .*{reason}"):
        read_mooncake(p)


def test_trace_time_must_not_go_back(tmp_path: Path) -> None:
    p = _write(tmp_path / "t.jsonl", [
        {"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 4, "input_length": 1, "output_length": 1, "hash_ids": [1]},
    ])
    with pytest.raises(TraceError, match="goes back in time"):
        read_mooncake(p)
    with pytest.raises(TraceError, match="cannot read trace"):
        read_mooncake(tmp_path / "missing.jsonl")
    with pytest.raises(TraceError, match="speed"):
        TraceOptions(speed=0)


# -- generator --------------------------------------------------------------------------


def test_generator_is_seeded_and_shares_prefixes() -> None:
    a = generate(WorkloadOptions(seed=3, sessions=12))
    assert a == generate(WorkloadOptions(seed=3, sessions=12))
    assert a != generate(WorkloadOptions(seed=4, sessions=12))
    assert [r.arrival_ms for r in a] == sorted(r.arrival_ms for r in a)
    # Sessions sharing a system prompt share its ids; a later turn extends an earlier one.
    firsts = {r.hash_ids[:8] for r in a}
    assert 1 < len(firsts) <= 4
    extends = [
        (x, y) for i, x in enumerate(a) for y in a[i + 1 :]
        if len(y.hash_ids) > len(x.hash_ids) and y.hash_ids[: len(x.hash_ids)] == x.hash_ids
    ]
    assert extends
    x, y = extends[0]
    assert y.tokens()[: x.input_length] == x.tokens()


# -- engine -----------------------------------------------------------------------------


class Writer:
    """Records router events from a consolidator (what the router would be told)."""

    def __init__(self) -> None:
        self.stores: list[tuple[Tier, int]] = []

    def stored(self, dp_rank, tier, parent_hash, block_hashes, tokens_hashes) -> None:  # type: ignore[no-untyped-def]
        self.stores.append((tier, len(block_hashes)))

    def removed(self, dp_rank, tier, block_hashes) -> None:  # type: ignore[no-untyped-def]
        pass

    def cleared(self, dp_rank, tier=None) -> None:  # type: ignore[no-untyped-def]
        pass


def _job(rid: str, tokens: list[int], at: float, out: int = 3) -> Job:
    local, seqs = block_hashes(tokens, 16)
    return Job(rid, at, len(tokens), out, local, seqs)


def test_engine_times_follow_the_cost_model(tmp_path: Path) -> None:
    cost = CostModel(prefill_ms_per_token=1.0, decode_ms_per_token=10.0, batch_limit=4, min_step_ms=0,
                     decode_ms_per_context_token=0)
    engine = SimEngine(0, EngineConfig(device_blocks=64, host_blocks=64, disk_blocks=0, cost=cost),
                       Consolidator(Writer()), tmp_path)
    prompt = list(range(100))  # 6 full blocks + 4 tokens
    engine.submit(_job("a", prompt, 0.0, out=3))
    end = engine.begin_step(0.0, next_arrival_s=float("inf"))
    assert end == pytest.approx(0.100)  # 100 uncached tokens × 1 ms
    step = engine.end_step(end)
    assert [j.request_id for j in step.first_tokens] == ["a"]
    # Nothing arrives: the two remaining decode steps are taken at once (2 × 10 ms × 1).
    end2 = engine.begin_step(end, float("inf"))
    assert end2 == pytest.approx(0.120)
    assert [j.request_id for j in engine.end_step(end2).finished] == ["a"]
    # The same prompt again hits its 6 blocks on G1: only the 4-token tail is computed.
    engine.submit(_job("b", prompt + [5] * 30, 1.0, out=1))
    end3 = engine.begin_step(1.0, float("inf"))
    assert end3 == pytest.approx(1.0 + (130 - 96) * 0.001)
    done = engine.end_step(end3)
    assert done.finished[0].device_blocks == 6 and done.finished[0].host_blocks == 0
    assert engine.begin_step(end3, float("inf")) is None
    engine.close()


def test_engine_onboards_from_host_after_eviction(tmp_path: Path) -> None:
    cost = CostModel(prefill_ms_per_token=1.0, onboard_host_ms_per_token=0.1)
    writer = Writer()
    engine = SimEngine(0, EngineConfig(device_blocks=8, host_blocks=32, disk_blocks=0, cost=cost),
                       Consolidator(writer, Mode.PASSTHROUGH), tmp_path)
    first, other = list(range(128)), list(range(1000, 1128))  # 8 blocks each: fills G1
    for rid, tokens, at in (("a", first, 0.0), ("b", other, 1.0), ("c", first, 2.0)):
        engine.submit(_job(rid, tokens, at, out=1))
        end = engine.begin_step(at, float("inf"))
        step = engine.end_step(end)
    job = step.finished[0]
    assert (job.device_blocks, job.host_blocks) == (0, 8)  # evicted from G1, kept on G2
    # Fully cached: the last token is computed (1 ms), the 128 others come from G2.
    assert end == pytest.approx(2.0 + (1 + 128 * 0.1) / 1000)
    assert (Tier.HOST_PINNED, 8) in writer.stores  # passthrough tells the router about G2
    with pytest.raises(SimulationError, match="device tier"):
        engine.submit(_job("huge", list(range(16 * 9)), 3.0))
    engine.close()


@pytest.mark.parametrize(("min_seen", "disk_blocks"), [(1, 4), (2, 0)])
def test_a_next_turn_finds_its_previous_turn_on_disk_after_one_sighting(
    tmp_path: Path, min_seen: int, disk_blocks: int
) -> None:
    """A turn's blocks were seen once (registered on G1) when G1 and G2 evict them; with
    the default filter (one sighting) they went on to G3 and the next turn onboards them
    from there; with "seen twice" they never reached G3 and are computed again."""
    engine = SimEngine(0, EngineConfig(device_blocks=8, host_blocks=8, disk_blocks=32, disk_min_seen=min_seen),
                       Consolidator(Writer()), tmp_path)
    turn = list(range(64))  # 4 blocks; the other prompt's 8 then fill G1 and G2
    for rid, tokens, at in (("turn1", turn, 0.0), ("other", list(range(1000, 1128)), 1.0),
                            ("turn2", turn + [7] * 16, 2.0)):
        engine.submit(_job(rid, tokens, at, out=1))
        step = engine.end_step(engine.begin_step(at, float("inf")))
    job = step.finished[0]
    assert (job.device_blocks, job.host_blocks, job.disk_blocks) == (0, 0, disk_blocks)
    engine.close()


def test_min_step_and_decode_cost_growing_with_the_batch_tokens(tmp_path: Path) -> None:
    cost = CostModel(prefill_ms_per_token=0.01, decode_ms_per_token=1.0, decode_ms_per_context_token=0.5,
                     min_step_ms=5.0, batch_limit=4, max_batch_tokens=64)
    engine = SimEngine(0, EngineConfig(device_blocks=64, host_blocks=64, disk_blocks=0, cost=cost),
                       Consolidator(Writer()), tmp_path)
    engine.submit(_job("a", [1, 2], 0.0, out=5))
    end = engine.begin_step(0.0, float("inf"))
    assert end == pytest.approx(0.005)  # 2 tokens × 0.01 ms: the minimum step
    engine.end_step(end)
    # 4 decode steps of one request whose context grows 3, 4, 5, 6 tokens:
    # max(5, 1 + 0.5·ctx) = 5, 5, 5, 5 ms... then with a longer context the KV reads dominate.
    end2 = engine.begin_step(end, float("inf"))
    assert end2 == pytest.approx(end + 4 * 0.005)
    engine.end_step(end2)
    engine.submit(_job("b", list(range(40)), 1.0, out=4))
    end3 = engine.end_step(engine.begin_step(1.0, float("inf"))).first_tokens[0].first_token_s
    end4 = engine.begin_step(end3, float("inf"))  # contexts 41, 42, 43: 1 + 0.5·ctx each
    assert end4 == pytest.approx(end3 + (21.5 + 22 + 22.5) / 1000)
    # Taken at once or one by one (an arrival after every step), the times are the same.
    assert cost.decode_steps_ms(3, 1, 41) == pytest.approx(21.5 + 22 + 22.5)
    assert cost.decode_steps_ms(5, 2, 0) == pytest.approx(sum(max(5.0, 2 + 0.5 * (2 * j)) for j in range(5)))
    engine.end_step(end4)
    engine.close()


def test_chunked_prefill_shares_the_token_budget_first_come_first_served(tmp_path: Path) -> None:
    cost = CostModel(prefill_ms_per_token=1.0, decode_ms_per_token=0, decode_ms_per_context_token=0,
                     min_step_ms=0, batch_limit=4, max_batch_tokens=128)
    engine = SimEngine(0, EngineConfig(device_blocks=64, host_blocks=64, disk_blocks=0, cost=cost),
                       Consolidator(Writer()), tmp_path)
    engine.submit(_job("long", list(range(300)), 0.0, out=2))
    t = engine.begin_step(0.0, float("inf"))
    assert t == pytest.approx(0.128) and not engine.end_step(t).first_tokens  # 128 of 300
    engine.submit(_job("short", list(range(1000, 1100)), t, out=1))
    t2 = engine.begin_step(t, float("inf"))  # long takes the whole budget: short waits
    assert t2 == pytest.approx(t + 0.128) and not engine.end_step(t2).first_tokens
    t3 = engine.begin_step(t2, float("inf"))  # long's last 44 tokens, then 84 of short's 100
    assert t3 == pytest.approx(t2 + 0.128)
    assert [j.request_id for j in engine.end_step(t3).first_tokens] == ["long"]
    t4 = engine.begin_step(t3, float("inf"))  # long decodes (1 token), short's last 16
    assert t4 == pytest.approx(t3 + 0.016)
    step = engine.end_step(t4)
    assert [j.request_id for j in step.first_tokens] == ["short"]
    assert sorted(j.request_id for j in step.finished) == ["long", "short"]
    with pytest.raises(SimulationError, match="max_batch_tokens"):
        CostModel(batch_limit=32, max_batch_tokens=32)
    engine.close()


# -- whole runs -------------------------------------------------------------------------


def _run(policy: str, mode: Mode = Mode.DEDUP, engine: EngineConfig = SMALL, seed: int = 0, sessions: int = 30):
    reqs = generate(WorkloadOptions(seed=1, sessions=sessions))
    return reqs, simulate(reqs, SimOptions(workers=4, policy=policy, mode=mode, seed=seed, engine=engine), memory_log)


@pytest.mark.parametrize("policy", ["kv", "round_robin", "random", "least_load"])
def test_every_policy_completes_every_request_deterministically(policy: str) -> None:
    reqs, a = _run(policy)
    assert sorted(r.request_id for r in a.requests) == sorted(r.request_id for r in reqs)
    assert [d[0] for d in a.decisions] == [r.request_id for r in reqs]
    assert all(r.arrival_s < r.first_token_s <= r.finish_s for r in a.requests)
    assert a.log.counters == {}  # the router applied every event the workers sent
    _, b = _run(policy)
    assert a.decisions == b.decisions
    s = summarize(a)
    assert s["policy"] == policy and s["requests"] == len(reqs)
    assert 0 <= s["ttft_p50_ms"] <= s["ttft_p90_ms"] <= s["ttft_p99_ms"]
    assert s["hit_rate"] == pytest.approx(s["hit_rate_device"] + s["hit_rate_host"] + s["hit_rate_disk"], abs=1e-3)


def test_round_robin_cycles_and_kv_finds_more_shared_prefixes() -> None:
    _, rr = _run("round_robin")
    assert [w for _, w in rr.decisions[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]
    _, kv = _run("kv")
    assert summarize(kv)["hit_rate"] > summarize(rr)["hit_rate"] + 0.1


def test_passthrough_shows_the_router_lower_tier_hits_that_dedup_hides() -> None:
    tight = EngineConfig(device_blocks=300, host_blocks=2000, disk_blocks=4000)
    _, dedup = _run("kv", Mode.DEDUP, tight, sessions=40)
    _, passthrough = _run("kv", Mode.PASSTHROUGH, tight, sessions=40)
    d, p = summarize(dedup), summarize(passthrough)
    assert d["hit_rate_host"] > 0 and p["hit_rate_host"] > 0  # the workers do onboard from G2
    assert d["router_hit_rate_host"] == 0 == d["router_hit_rate_disk"]  # dedup: all looks like device
    assert p["router_hit_rate_host"] > 0


def test_plot_and_cli(tmp_path: Path) -> None:
    _, kv = _run("kv", sessions=10)
    _, rr = _run("round_robin", sessions=10)
    out = tmp_path / "p.png"
    plot([kv, rr], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    runner = CliRunner()
    res = runner.invoke(cli, ["simulate", "--sessions", "8", "--workers", "3", "--policy", "kv", "--json",
                              "--device-tokens", "8000", "--no-progress"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    for key in ("policy", "requests", "hit_rate", "ttft_p50_ms", "ttft_p99_ms", "hit_rate_device", "hit_rate_host",
                "hit_rate_disk", "events_per_s", "load_imbalance_busy", "e2e_p99_ms"):
        assert key in doc
    res = runner.invoke(cli, ["simulate", "--sessions", "6", "--policy", "kv", "--policy", "random", "--json",
                              "--no-progress", "--plot", str(tmp_path / "two.png")])
    assert res.exit_code == 0, res.output
    assert [r["policy"] for r in json.loads(res.stdout.strip().splitlines()[-1])["runs"]] == ["kv", "random"]
    res = runner.invoke(cli, ["simulate", "--trace", str(tmp_path / "none.jsonl")])
    assert res.exit_code != 0 and "cannot read trace" in res.output
    res = runner.invoke(cli, ["simulate", "--sessions", "6", "--device-tokens", "64"])
    assert res.exit_code != 0 and "raise --device-tokens" in res.output
    res = runner.invoke(cli, ["simulate", "--replicas", "2"])
    assert res.exit_code != 0 and "need --bootstrap" in res.output


# -- the shared trace (absent from a fresh clone) ---------------------------------------

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_fast25_conversation_trace.jsonl"


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.is_file(), reason=f"the Mooncake trace is not at {TRACE} (../shared/traces of the repo)")
def test_mooncake_trace_prefix_kv_beats_round_robin() -> None:
    reqs = read_mooncake(TRACE, TraceOptions(limit=400))
    engine = EngineConfig(device_blocks=512, host_blocks=2048, disk_blocks=8192, block_size=512)
    out = {}
    for policy in ("kv", "round_robin"):
        res = simulate(reqs, SimOptions(workers=8, policy=policy, engine=engine), memory_log)
        assert len(res.requests) == 400
        out[policy] = summarize(res)
    assert out["kv"]["hit_rate"] > out["round_robin"]["hit_rate"]
    assert out["kv"]["ttft_p50_ms"] <= out["round_robin"]["ttft_p50_ms"]
