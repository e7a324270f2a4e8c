"""A relayed request leaves no reference cycle behind: its objects are freed when it
ends, not by the cyclic collector, whose passes stall the event loop (the relay's p99).
One cycle per request (the response's transport view and uvicorn's request cycle
referring to each other) was the gateway's whole share of the collector's work."""

from __future__ import annotations

import gc

import httpx
import orjson
import pytest

from kvstream.replica.replica import Replica
from tests.gateway.backends import Backend, running
from tests.gateway.fleet import MODEL, TOKEN, serving

pytestmark = pytest.mark.kafka


def _ours(garbage: list[object]) -> list[str]:
    names = (f"{type(o).__module__}.{type(o).__qualname__}" for o in garbage)
    return sorted({n for n in names if n.startswith(("kvstream.", "uvicorn.", "starlette."))})


def test_relayed_requests_leave_no_garbage_cycles(replica: Replica, prompt_tokenizer) -> None:
    with running(Backend("a", chunks=5)) as (a,), serving(replica, [a], {MODEL: prompt_tokenizer}) as s, \
            httpx.Client(base_url=s.base_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
        bodies = [orjson.dumps({"model": MODEL, "prompt": f"request {i}", "max_tokens": 5, "stream": i % 2 == 1})
                  for i in range(40)]
        client.post("/v1/completions", content=bodies[0]).raise_for_status()  # warm: lazy imports, pools
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for body in bodies:
                r = client.post("/v1/completions", content=body)
                assert r.status_code == 200, r.text
            gc.collect()
            found = _ours(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert found == [], f"objects left in reference cycles by relayed requests: {found}"
