"""kvstream.tools.fleet's replayer is not the limit of a fleet benchmark: with every
request on one base URL (a router's), as many streams as the trace asks for are in
flight at once and each request leaves when it is due.

Before the replayer used the SDK's aiohttp transport, httpx's connection pool held
requests back for seconds when one base URL carried them all (here: TTFT p90 4.3 s at
the client against the engine's own tens of ms), which made every router look slower
than round-robin (which spreads the requests over one pool per engine).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvstream.tools import fleet
from kvstream.tools.simulate.trace import Request
from tests.emulator.conftest import Emulator


@pytest.mark.timeout(180)
def test_one_base_url_is_not_held_back_by_the_client(emulator_factory: Callable[..., Emulator]) -> None:
    # Room for every stream at once: the engine never makes a request wait.
    emu = emulator_factory("--model", fleet.MODEL, "--max-num-seqs", "512")
    scale = fleet.Scale()
    # 50 requests/s for 8 s, each a 1-token prompt streaming 30 tokens (480 ÷ 16).
    reqs = [Request(f"r{i}", i * 20.0, 16, 480, (i,)) for i in range(400)]
    s = fleet.replay(reqs, scale, lambda i: emu.url)
    assert s.failed == 0, s.errors
    engine_ttft_ms = 1000 * emu.metric("vllm:time_to_first_token_seconds_sum") / emu.metric(
        "vllm:time_to_first_token_seconds_count")
    # The client's TTFT is the engine's plus the trip: not seconds of waiting for a connection.
    assert s.ttft_p90_ms < engine_ttft_ms + 1000, (s.ttft_p90_ms, engine_ttft_ms)
