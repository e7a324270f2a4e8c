"""``kvstream emulate --data-parallel-size N``: N ranks behind one HTTP server, as vLLM's
internal load balancing serves them. Each rank has its own cache and KV events (port +
rank, stamped with the rank, read with vLLM's ``KVEventBatch``); ``X-data-parallel-rank``
routes, the least loaded rank otherwise; /metrics keeps each rank's series apart."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from engines.conftest import eventually
from engines.engines import EngineKit
from prometheus_client.parser import text_string_to_metric_families

from kvstream.tools.procs import free_port

from .conftest import KVSTREAM, Emulator, EventTap
from .test_disagg import LEG, legs, routed
from .test_kv_events import replay

RANKS = 4


def at_rank(endpoint: str, rank: int) -> str:
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) + rank}"


def complete(emu: Emulator, body: dict[str, Any], rank: int | str | None = None) -> httpx.Response:
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    return httpx.post(emu.url + "/v1/completions", json=body, headers=headers, timeout=60)


def per_rank(emu: Emulator, name: str) -> dict[str, float]:
    """A series' value by ``engine`` label."""
    [family] = [f for f in text_string_to_metric_families(emu.get("/metrics")) if f.name == name]
    return {s.labels["engine"]: s.value for s in family.samples if s.name in (name, name + "_total")}


def test_the_header_routes_to_its_rank_and_its_events(
        emulator_factory: Callable[..., Emulator], tap_factory: Callable[[str], EventTap], vllm: EngineKit) -> None:
    emu = emulator_factory("--speed", "20", "--data-parallel-size", str(RANKS), ranks=RANKS)
    taps = [tap_factory(at_rank(emu.events, r)) for r in range(RANKS)]
    prompts = [list(range(1000 * (r + 1), 1000 * (r + 1) + 40)) for r in range(RANKS)]  # 2 full blocks each
    for r in (2, 0, 3, 1):
        resp = complete(emu, {"prompt": prompts[r], "max_tokens": 2}, rank=r)
        assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Each rank its own cache: a repeat hits on its rank only.
    assert complete(emu, {"prompt": prompts[1], "max_tokens": 1}, rank=1).json()["usage"][
        "prompt_tokens_details"]["cached_tokens"] == 32
    assert complete(emu, {"prompt": prompts[1], "max_tokens": 1}, rank=2).json()["usage"][
        "prompt_tokens_details"]["cached_tokens"] == 0
    for r, tap in enumerate(taps):
        batches = tap.batches(timeout=0.5)
        assert batches and all(b.data_parallel_rank == r for _, b in batches)
        stored = [e for _, b in batches for e in b.events if isinstance(e, vllm.mod.BlockStored)]
        # The full blocks of the prompts it served (rank 2 also rank 1's), none of another's.
        served = [r, 1] if r == 2 else [r]
        assert [e.token_ids for e in stored] == [prompts[p][:32] for p in served]
        assert [seq for _, seq, _ in replay(at_rank(emu.replay, r), 0)] == [s for s, _ in batches]
        assert per_rank(emu, "vllm:prompt_tokens")[str(r)] == 40 * (2 if r in (1, 2) else 1)
    # /reset_prefix_cache resets every rank, each announcing it on its own socket.
    assert emu.post("/reset_prefix_cache", {})[0] == 200
    for r, tap in enumerate(taps):
        [(_, batch)] = tap.batches(timeout=0.5)
        assert batch.data_parallel_rank == r and isinstance(batch.events[0], vllm.mod.AllBlocksCleared)


def test_without_the_header_the_least_loaded_rank_serves(emulator_factory: Callable[..., Emulator]) -> None:
    emu = emulator_factory("--speed", "1", "--data-parallel-size", str(RANKS), ranks=RANKS)
    body = {"prompt": list(range(64)), "max_tokens": 200}  # ~1 s of decode: all in flight together
    results: list[int] = []

    def send(rank: int | None) -> None:
        results.append(complete(emu, body, rank).status_code)

    pinned = [threading.Thread(target=send, args=(0,)) for _ in range(2)]
    for t in pinned:
        t.start()
    eventually(lambda: per_rank(emu, "vllm:num_requests_running")["0"], 2)
    # Round robin would put 2 of these 6 on rank 0 again; least loaded fills ranks 1-3.
    free = [threading.Thread(target=send, args=(None,)) for _ in range(6)]
    for t in free:
        t.start()
    for t in pinned + free:
        t.join()
    assert results == [200] * 8
    assert per_rank(emu, "vllm:request_success") == {str(r): 2 for r in range(RANKS)}
    # The counters are back to 0 on every rank.
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert per_rank(emu, name) == {str(r): 0 for r in range(RANKS)}, name


def test_metrics_list_each_family_once_with_a_label_set_per_rank(emulator_factory: Callable[..., Emulator]) -> None:
    emu = emulator_factory("--speed", "20", "--data-parallel-size", "2")
    assert complete(emu, {"prompt": list(range(20)), "max_tokens": 3}, rank=1).status_code == 200
    text = emu.get("/metrics")
    assert text.count("# HELP vllm:generation_tokens_total ") == 1
    assert per_rank(emu, "vllm:generation_tokens") == {"0": 0, "1": 3}
    assert emu.metric("vllm:generation_tokens_total") == 3  # the engine's total: the sum over ranks
    assert emu.metric("vllm:e2e_request_latency_seconds_count", engine=1) == 1
    assert emu.metric("vllm:e2e_request_latency_seconds_count", engine=0) == 0


def test_a_rank_out_of_range_is_vllms_400(emulator_factory: Callable[..., Emulator]) -> None:
    emu = emulator_factory("--speed", "20", "--data-parallel-size", "2")
    for header in ("2", "-1"):
        resp = complete(emu, {"prompt": "hi", "max_tokens": 1}, rank=header)
        assert resp.status_code == 400
        assert resp.json() == {"error": {"message": f"data_parallel_rank {header} is out of range [0, 2).",
                                         "type": "BadRequestError", "param": None, "code": 400}}
    # Not an integer: vLLM's _get_data_parallel_rank ignores it (the request is balanced).
    assert complete(emu, {"prompt": "hi", "max_tokens": 1}, rank="one").status_code == 200
    assert emu.metric("vllm:request_success_total") == 1 and emu.metric("vllm:num_requests_running") == 0


def test_a_first_rank_with_several_is_refused() -> None:
    run = subprocess.run([KVSTREAM, "emulate", "--port", "1", "--data-parallel-size", "2", "--data-parallel-rank",
                          "1"], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "--data-parallel-rank is for a one-rank engine" in run.stderr, run.stderr


def test_nixl_prefill_ranks_name_their_engine(emulator_factory: Callable[..., Emulator]) -> None:
    """vLLM suffixes each rank's KV connector engine id with ``_dp<rank>``."""
    prefill = emulator_factory("--role", "prefill", "--handoff", "nixl", "--data-parallel-size", "2")
    decode = emulator_factory("--role", "decode", "--handoff", "nixl", "--data-parallel-size", "2")
    body = {"prompt": list(range(100)), "max_tokens": 5}
    ids = []
    for r in (0, 1):
        resp = complete(prefill, {**body, "kv_transfer_params": LEG, "max_tokens": 1}, rank=r)
        ids.append(resp.json()["kv_transfer_params"]["remote_engine_id"])
    base = ids[0].removesuffix("_dp0")
    assert str(uuid.UUID(base)) == base and ids == [f"{base}_dp0", f"{base}_dp1"]
    params = complete(prefill, {**body, "kv_transfer_params": LEG, "max_tokens": 1}, rank=1).json()[
        "kv_transfer_params"]
    resp = complete(decode, {**body, "kv_transfer_params": params}, rank=1)
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 99
    received = "kvstream_emulator_kv_transfer_received_tokens"
    assert per_rank(decode, received) == {"0": 0, "1": 100}
    for emu in (prefill, decode):
        assert emu.metric("vllm:num_requests_running") == emu.metric("vllm:num_requests_waiting") == 0


def test_bootstrap_rooms_are_the_servers_and_name_the_rank(emulator_factory: Callable[..., Emulator]) -> None:
    port = free_port()
    prefill = emulator_factory("--role", "prefill", "--handoff", "bootstrap", "--bootstrap-port", str(port),
                               "--data-parallel-size", "2")
    decode = emulator_factory("--role", "decode", "--handoff", "bootstrap", "--data-parallel-size", "2")
    for room in (11, 12):  # both legs balanced: each on the idle rank 0
        body = {"prompt": list(range(room * 100, room * 100 + 64)), "max_tokens": 4}
        p, d, _ = asyncio.run(legs(prefill, decode, routed(body, port, room)))
        assert isinstance(p, httpx.Response) and p.status_code == 200 and d.status_code == 200, (p, d.text)
    ready = httpx.get(f"http://127.0.0.1:{port}/kv/12", timeout=10).json()
    assert ready["room"] == 12 and ready["engine_id"].endswith("_dp0")
    assert per_rank(decode, "kvstream_emulator_kv_transfer_received_tokens") == {"0": 128, "1": 0}


@pytest.mark.parametrize("size", ["0", "x"])
def test_a_bad_size_is_refused(size: str) -> None:
    run = subprocess.run([KVSTREAM, "emulate", "--port", "1", "--data-parallel-size", size],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "--data-parallel-size" in run.stderr
