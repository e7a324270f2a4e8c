"""The generated traces (kvstream.tools.simulate.shapes, ``kvstream workload``): seeded,
read back by the Mooncake reader the benches use, valid for aiperf's Mooncake replay
(a hash id is one block's text: a prompt's partial last block is its own), and shaped
as described (what is shared, and how much of it a cache could reuse)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstream.tools.simulate.errors import SimulationError
from kvstream.tools.simulate.shapes import SHAPES, generate_shape, stats, workload, write_mooncake
from kvstream.tools.simulate.trace import MOONCAKE_TOKENS_PER_ID, TraceOptions, read_mooncake


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_shape_is_a_valid_mooncake_trace(shape: str, tmp_path: Path) -> None:
    reqs = generate_shape(shape, 300, seed=3)
    assert reqs == generate_shape(shape, 300, seed=3) != generate_shape(shape, 300, seed=4)
    assert len(reqs) == 300 and all(a.arrival_ms <= b.arrival_ms for a, b in zip(reqs, reqs[1:]))
    path = tmp_path / "trace.jsonl"
    write_mooncake(reqs, path)
    back = read_mooncake(path, TraceOptions())
    assert [(r.input_length, r.hash_ids) for r in back] == [(r.input_length, r.hash_ids) for r in reqs]
    tails = {r.hash_ids[-1] for r in reqs}
    assert not tails & {h for r in reqs for h in r.hash_ids[:-1]}
    assert all((len(r.hash_ids) - 1) * MOONCAKE_TOKENS_PER_ID < r.input_length < len(r.hash_ids) * MOONCAKE_TOKENS_PER_ID
               for r in reqs)


def test_the_shapes_share_what_they_say() -> None:
    agents, users, docs = (generate_shape(s, 400) for s in ("agentic", "system-prompts", "long-docs"))
    # Agent sessions grow their context turn after turn: most of each prompt was seen.
    assert stats(agents).reusable_share > 0.85
    # Four system prompts: the first blocks of every request are one of four.
    assert len({r.hash_ids[:8] for r in users}) == 4
    assert 0.5 < stats(users).reusable_share < 0.8
    # Forty documents behind one instruction block, the popular ones asked again and again.
    assert len({r.hash_ids[0] for r in docs}) == 1 and len({r.hash_ids[1] for r in docs}) <= 40
    assert stats(docs).reusable_share > 0.8
    for reqs in (agents, users, docs):  # about the conversation trace's rate and size
        s = stats(reqs)
        assert 1.5 < s.requests / s.seconds < 5 and 5_000 < s.mean_input_tokens < 40_000


def test_the_command_writes_a_trace_and_refuses_nonsense(tmp_path: Path) -> None:
    out = tmp_path / "agents.jsonl"
    res = CliRunner().invoke(workload, ["agentic", "--requests", "50", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "50 requests" in res.output and len(out.read_text().splitlines()) == 50
    res = CliRunner().invoke(workload, ["chatty", "-o", str(out)])
    assert res.exit_code == 2 and "chatty" in res.output
    with pytest.raises(SimulationError, match="at least one"):
        generate_shape("agentic", 0)
