"""``kvstream emulate --role prefill|decode``: one leg of a disaggregated request, by vLLM's
NixlConnector hand-off (the router relays ``kv_transfer_params``) and by SGLang's
bootstrap hand-off (both legs at once, the decode leg waits on the prefill engine's
bootstrap server). The hand-off's names are read from the pinned wheels' source."""

from __future__ import annotations

import ast
import asyncio
import json
import math
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestClient, TestServer
from engines.engines import EngineKit, wheel_source

from kvstream.emulator import handoff
from kvstream.emulator.errors import EmulatorConfigError
from kvstream.emulator.options import EmulatorOptions
from kvstream.tools.procs import free_port

from .conftest import KVSTREAM, Emulator, EventTap, start_emulator, stop_emulator

PROMPT = list(range(3000, 3000 + 1024))  # 64 full blocks of 16
#: Slow prefill compute (1,024 tokens: ~1 s), so that a received prompt is visibly not computed.
SLOW = ("--prefill-ms-per-token", "1.0")
LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
       "remote_host": None, "remote_port": None}


def nixl_keys() -> set[str]:
    """The keywords of the ``dict(...)`` vLLM's NixlConnector ``request_finished`` returns."""
    src = wheel_source("vllm", "vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py")
    [fn] = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "request_finished"]
    calls = [c for r in ast.walk(fn) if isinstance(r, ast.Return) and isinstance(r.value, ast.Tuple)
             for c in r.value.elts if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "dict"]
    assert len(calls) == 1
    return {k.arg for k in calls[0].keywords if k.arg is not None}


def sglang_routing_fields() -> set[str]:
    src = wheel_source("sglang", "sglang/srt/entrypoints/openai/protocol.py")
    [cls] = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == "PDRoutingFields"]
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def post(emu: Emulator, path: str, body: dict[str, Any], **headers: str) -> tuple[int, Any, float]:
    """(status, JSON body, seconds) of a non-streamed request."""
    start = time.monotonic()
    resp = httpx.post(emu.url + path, json=body, headers=headers, timeout=60)
    return resp.status_code, resp.json(), time.monotonic() - start


def stream(emu: Emulator, path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    """(chunks, seconds to the first) of a streamed request."""
    start, first, chunks = time.monotonic(), None, []
    with httpx.stream("POST", emu.url + path, json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                first = first or time.monotonic() - start
                chunks.append(json.loads(line[6:]))
    assert first is not None
    return chunks, first


def idle(*engines: Emulator) -> None:
    for emu in engines:
        assert emu.metric("vllm:num_requests_running") == emu.metric("vllm:num_requests_waiting") == 0


def received(emu: Emulator) -> float:
    return emu.metric("kvstream_emulator_kv_transfer_received_tokens_total")


# -- options ----------------------------------------------------------------------------
def test_help_shows_the_flags() -> None:
    out = subprocess.run([KVSTREAM, "emulate", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--role [both|prefill|decode]", "--handoff [nixl|bootstrap]", "--bootstrap-port",
                 "--kv-transfer-ms-per-token"):
        assert flag in out


@pytest.mark.parametrize(("args", "reason"), [
    (["--role", "prefill"], "role prefill needs a handoff protocol (--handoff"),
    (["--role", "decode"], "role decode needs a handoff protocol"),
    (["--handoff", "nixl"], "not role both"),
    (["--role", "prefill", "--handoff", "bootstrap"], "needs its bootstrap server's port (--bootstrap-port)"),
    (["--role", "decode", "--handoff", "bootstrap", "--bootstrap-port", "9000"], "only for role prefill"),
    (["--role", "prefill", "--handoff", "nixl", "--bootstrap-port", "9000"], "only for role prefill"),
    (["--role", "middle"], "'middle' is not one of"),
    (["--kv-transfer-ms-per-token", "-1"], "kv_transfer_ms_per_token must be a finite number >= 0"),
])
def test_bad_combinations_are_refused_with_the_reason(args: list[str], reason: str) -> None:
    run = subprocess.run([KVSTREAM, "emulate", "--port", "1", *args], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and reason in run.stderr, run.stderr


def test_options_check_role_and_handoff() -> None:
    assert EmulatorOptions().role == "both"
    EmulatorOptions(role="prefill", handoff="bootstrap", bootstrap_port=9000)
    for bad in (dict(role="decoder", handoff="nixl"), dict(role="decode", handoff="tcp"),
                dict(role="prefill", handoff="bootstrap", bootstrap_port=0)):
        with pytest.raises(EmulatorConfigError):
            EmulatorOptions(**bad)  # type: ignore[arg-type]


# -- the names of the engines' hand-offs ---------------------------------------------------
def test_bootstrap_fields_are_sglangs() -> None:
    assert set(handoff.BOOTSTRAP_FIELDS) <= sglang_routing_fields()


# -- nixl -------------------------------------------------------------------------------
@pytest.fixture
def nixl(emulator_factory: Callable[..., Emulator]) -> tuple[Emulator, Emulator]:
    common = ("--max-model-len", "4096", *SLOW)
    return (emulator_factory("--role", "prefill", "--handoff", "nixl", *common),
            emulator_factory("--role", "decode", "--handoff", "nixl", *common))


def prefill_leg(emu: Emulator, path: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
    """What vLLM's toy proxy sends the prefill engine, and the params of its answer."""
    leg = {**body, "kv_transfer_params": LEG, "stream": False, "max_tokens": 1}
    leg.pop("stream_options", None)
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    status, answer, _ = post(emu, path, leg, **{"X-Request-Id": rid})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 1
    return answer  # type: ignore[no-any-return]


def test_nixl_prefill_answers_vllms_kv_transfer_params(nixl: tuple[Emulator, Emulator],
                                                       tap_factory: Callable[[str], EventTap],
                                                       vllm: EngineKit) -> None:
    prefill, _ = nixl
    tap = tap_factory(prefill.events)
    rid = uuid.uuid4().hex
    answer = prefill_leg(prefill, "/v1/completions", {"prompt": PROMPT[:100], "max_tokens": 30}, rid)
    params = answer["kv_transfer_params"]
    assert set(params) == nixl_keys()
    assert answer["id"] == f"cmpl-{rid}" and params["remote_request_id"].startswith(f"cmpl-{rid}-")
    assert str(uuid.UUID(params["remote_engine_id"])) == params["remote_engine_id"]
    # A fresh engine's first request takes the pool's first blocks: 7 for 100 tokens.
    assert params["remote_block_ids"] == [list(range(math.ceil(100 / 16)))]
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", prefill.port)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_num_tokens"] == 100 and params["transfer_mode"] == "pull"
    assert (params["tp_size"], params["dcp_size"], params["pp_size"]) == (1, 1, 1)
    assert params["remote_blocks_expiry_time"] is None and params["remote_registration_generation"] == 0
    # The prefill was computed as usual, with its KV events.
    events = [e for _, b in tap.batches() for e in b.events if isinstance(e, vllm.mod.BlockStored)]
    assert [h for e in events for h in e.block_hashes] and events[0].token_ids == PROMPT[:96]
    again = prefill_leg(prefill, "/v1/completions", {"prompt": PROMPT[:100]}, "r2")
    assert again["kv_transfer_params"]["remote_engine_id"] == params["remote_engine_id"]
    # Without do_remote_decode: a plain request, answered as a role both engine would.
    status, plain, _ = post(prefill, "/v1/completions", {"prompt": PROMPT[:100], "max_tokens": 3})
    assert status == 200 and plain["kv_transfer_params"] is None and plain["usage"]["completion_tokens"] == 3
    idle(prefill)


@pytest.mark.parametrize("chat", [False, True])
def test_nixl_decode_receives_the_prompt_instead_of_computing_it(
        nixl: tuple[Emulator, Emulator], tap_factory: Callable[[str], EventTap], vllm: EngineKit, chat: bool) -> None:
    prefill, decode = nixl
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(1020))}]}
                            if chat else {"prompt": PROMPT})
    body["max_tokens"] = 20
    p_tap, d_tap = tap_factory(prefill.events), tap_factory(decode.events)
    start = time.monotonic()
    params = prefill_leg(prefill, path, body, "r1")["kv_transfer_params"]
    computed_s = time.monotonic() - start
    n = params["remote_num_tokens"]
    assert n > 1000 and computed_s >= n * 1.0 / 1000  # the prefill engine computed it
    status, whole, decode_s = post(decode, path, {**body, "kv_transfer_params": params})
    assert status == 200 and whole["usage"]["completion_tokens"] == 20 and whole["kv_transfer_params"] is None
    assert whole["usage"]["prompt_tokens"] == n and whole["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    # Received (2.7 ms) and 20 decode steps (0.1 s), not computed (1 s).
    assert decode_s < computed_s / 3, (decode_s, computed_s)
    assert received(decode) == n and decode.metric("vllm:external_prefix_cache_hits_total") == n
    # The decode engine announces the prompt's blocks as computed: the prefill's own chain.
    p_stored = [e for _, b in p_tap.batches() for e in b.events if isinstance(e, vllm.mod.BlockStored)]
    d_stored = [e for _, b in d_tap.batches() for e in b.events if isinstance(e, vllm.mod.BlockStored)]
    full = n // 16
    assert d_stored[0].parent_block_hash is None and len(d_stored[0].block_hashes) == full
    assert d_stored[0].block_hashes == [h for e in p_stored for h in e.block_hashes][:full]
    # Streamed, the prompt now in G1: only the rest of the last block is received.
    chunks, ttft = stream(decode, path, {**body, "kv_transfer_params": params,
                                         "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens"] == 20 and ttft < computed_s / 3
    assert received(decode) == n + (n - full * 16 if n % 16 else 16)
    idle(prefill, decode)


def test_nixl_decode_without_params_and_with_malformed_ones(nixl: tuple[Emulator, Emulator]) -> None:
    prefill, decode = nixl
    # No kv_transfer_params: computed, as a role both engine (and vLLM) would.
    status, plain, took = post(decode, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and took >= len(PROMPT) * 1.0 / 1000 and received(decode) == 0
    good = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e", "remote_request_id": "r",
            "remote_host": "127.0.0.1", "remote_port": 1, "remote_block_ids": [[0, 1]]}
    for bad in ("yes", [1], {**good, "do_remote_prefill": "yes"}, {**good, "remote_block_ids": [[0, "1"]]},
                {**good, "remote_block_ids": [0, 1]}, {**good, "remote_port": "80"},
                {k: v for k, v in good.items() if k != "remote_engine_id"}):
        for emu in (decode, prefill) if not isinstance(bad, dict) else (decode,):
            status, answer, _ = post(emu, "/v1/completions", {"prompt": "hi", "kv_transfer_params": bad})
            assert status == 400 and answer["error"]["param"] == "kv_transfer_params", (bad, answer)
            assert answer["error"]["type"] == "BadRequestError"
    idle(prefill, decode)


# -- bootstrap --------------------------------------------------------------------------
def bootstrap_pair(emulator_factory: Callable[..., Emulator], port: int) -> tuple[Emulator, Emulator]:
    common = ("--max-model-len", "8192", *SLOW)
    return (emulator_factory("--role", "prefill", "--handoff", "bootstrap", "--bootstrap-port", str(port), *common),
            emulator_factory("--role", "decode", "--handoff", "bootstrap", *common))


def routed(body: dict[str, Any], port: int, room: int | None = None) -> dict[str, Any]:
    room = uuid.uuid4().int % 2**63 if room is None else room
    return {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}


async def legs(prefill: Emulator, decode: Emulator, body: dict[str, Any], *, decode_first_s: float = 0.0,
               prefill_timeout: float = 60) -> tuple[httpx.Response | Exception, httpx.Response, float]:
    """Both legs as sglang-router sends them: the prefill's answer (or its client's
    error), the decode's, and the decode's seconds."""
    async with httpx.AsyncClient(timeout=60) as client:
        async def decode_leg() -> tuple[httpx.Response, float]:
            start = time.monotonic()
            resp = await client.post(decode.url + "/v1/completions", json=body)
            return resp, time.monotonic() - start

        async def prefill_leg() -> httpx.Response | Exception:
            await asyncio.sleep(decode_first_s)
            try:
                return await client.post(prefill.url + "/v1/completions", json=body, timeout=prefill_timeout)
            except httpx.HTTPError as exc:  # its client gave up, or its engine died
                return exc

        (d, took), p = await asyncio.gather(decode_leg(), prefill_leg())
    return p, d, took


def test_bootstrap_legs_at_once_and_decode_first(emulator_factory: Callable[..., Emulator]) -> None:
    port = free_port()
    prefill, decode = bootstrap_pair(emulator_factory, port)
    for i, first_s in enumerate((0.0, 0.5)):  # the decode leg may come first: it waits for the room
        prompt = [t + 10_000 * i for t in PROMPT]  # each prefilled from scratch
        p, d, took = asyncio.run(legs(prefill, decode, routed({"prompt": prompt, "max_tokens": 20}, port),
                                      decode_first_s=first_s))
        assert isinstance(p, httpx.Response) and p.status_code == 200, p
        assert p.json()["usage"]["completion_tokens"] == 1  # SGLang's prefill answers after its step
        assert d.status_code == 200, d.text
        assert d.json()["usage"]["completion_tokens"] == 20 and d.json()["usage"]["prompt_tokens"] == len(PROMPT)
        assert took >= first_s + len(PROMPT) * 1.0 / 1000 / 2  # it waited for the prefill
    assert received(decode) == 2 * len(PROMPT)
    idle(prefill, decode)


def test_bootstrap_decode_fails_when_the_prefill_is_aborted_or_killed(
        emulator_factory: Callable[..., Emulator]) -> None:
    port = free_port()
    prefill, decode = bootstrap_pair(emulator_factory, port)
    long = {"prompt": list(range(6000)), "max_tokens": 5}  # 6 s of prefill
    start = time.monotonic()
    p, d, _ = asyncio.run(legs(prefill, decode, routed(long, port, room=7), prefill_timeout=0.5))
    assert isinstance(p, httpx.TimeoutException) and time.monotonic() - start < 4
    assert d.status_code == 500 and d.json()["error"]["type"] == "InternalServerError"
    message = d.json()["error"]["message"]
    assert "KV transfer from bootstrap host 127.0.0.1" in message and "room 7 failed: HTTP 410" in message, message
    # A killed prefill engine: the decode leg fails at once, it does not hang.
    other = free_port()
    doomed = start_emulator("--role", "prefill", "--handoff", "bootstrap", "--bootstrap-port", str(other), *SLOW)
    try:
        async def kill_during() -> tuple[httpx.Response | Exception, httpx.Response, float]:
            task = asyncio.create_task(legs(doomed, decode, routed(long, other), prefill_timeout=30))
            await asyncio.sleep(1.0)
            doomed.proc.kill()
            return await task

        p, d, took = asyncio.run(kill_during())
        assert d.status_code == 500 and took < 5 and "failed" in d.json()["error"]["message"]
    finally:
        stop_emulator(doomed)
    idle(prefill, decode)
    assert received(decode) == 0


def test_bootstrap_bad_fields_are_refused(emulator_factory: Callable[..., Emulator]) -> None:
    port = free_port()
    for emu in bootstrap_pair(emulator_factory, port):
        for fields in ({"bootstrap_room": None}, {"bootstrap_port": "80"}, {"bootstrap_room": -1},
                       {"bootstrap_room": [1, 2]}, {"bootstrap_host": 1}, {"bootstrap_room": True}):
            status, answer, _ = post(emu, "/v1/completions", {**routed({"prompt": "hi"}, port), **fields})
            assert status == 400 and answer["error"]["param"] in fields, (fields, answer)
        idle(emu)


def test_bootstrap_server_answers_an_unknown_room_with_404(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff, "ROOM_WAIT_S", 0.2)

    async def main() -> None:
        rooms = handoff.Rooms()
        async with TestClient(TestServer(rooms.app())) as client:
            resp = await client.get("/kv/5")
            assert resp.status == 404 and (await resp.json())["room"] == 5
            waiting = asyncio.create_task(client.get("/kv/6"))  # before its prefill leg
            await asyncio.sleep(0.05)
            rooms.open(6)
            await asyncio.sleep(0.3)  # past the wait for an unknown room: known now, it waits on
            assert not waiting.done()
            rooms.close(6, None, "engine-1")
            resp = await waiting
            assert resp.status == 410 and "failed or was aborted" in (await resp.json())["error"]

    asyncio.run(main())
