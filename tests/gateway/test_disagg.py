"""Disaggregated serving through the gateway (issue 34): a model served by prefill and
decode workers gets two legs per request, in the engines' own protocols, through emulated
engines (``kvstream emulate --role``) driven by the official ``openai`` SDK; the legs'
bodies are checked against the engines' protocol classes read from their pinned wheels."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import openai
import orjson
import pytest
from engines.engines import wheel_source

from kvstream.gateway import disagg
from kvstream.gateway.errors import ApiError
from kvstream.gateway.seams import WorkerEndpoint
from kvstream.replica.replica import Replica
from kvstream.roles import Handoff, Role
from kvstream.tools.procs import free_port

from tests.emulator.conftest import Emulator, start_emulator, stop_emulator
from tests.gateway.fleet import MODEL, Served, load_of, serving, wait_until
from tests.gateway.test_relay import metric

pytestmark = pytest.mark.kafka


def _ep(wid: int, role: Role, handoff: Handoff | None = None, port: int | None = None) -> WorkerEndpoint:
    return WorkerEndpoint(wid, f"http://10.0.0.{wid}:8000", (MODEL,), role=role, handoff=handoff, bootstrap_port=port)


# -- the plan and the legs' bodies -------------------------------------------------------------


def test_a_fleet_without_prefill_workers_serves_whole_requests() -> None:
    assert disagg.plan([_ep(1, Role.BOTH), _ep(2, Role.BOTH)], MODEL, 1) is None


def test_the_plan_takes_the_prefill_workers_hand_off() -> None:
    eps = [_ep(1, Role.PREFILL, Handoff.NIXL), _ep(2, Role.DECODE, Handoff.NIXL), _ep(3, Role.DECODE, Handoff.BOOTSTRAP),
           _ep(4, Role.BOTH)]
    plan = disagg.plan(eps, MODEL, 1)
    assert plan is not None and plan.handoff is Handoff.NIXL
    assert [e.worker_id for e in plan.prefill] == [1] and [e.worker_id for e in plan.decode] == [2]


def test_prefill_workers_without_a_decode_worker_are_503() -> None:
    with pytest.raises(ApiError) as err:
        disagg.plan([_ep(1, Role.PREFILL, Handoff.NIXL), _ep(3, Role.DECODE, Handoff.BOOTSTRAP)], MODEL, 1)
    assert err.value.status == 503 and "no decode worker" in err.value.message


def test_the_nixl_prefill_leg_is_one_unstreamed_token_that_keeps_its_kv() -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 50, "temperature": 0.5}
    leg = orjson.loads(disagg.nixl_prefill_body(body))
    assert leg["stream"] is False and leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    assert "stream_options" not in leg and leg["temperature"] == 0.5 and leg["messages"] == body["messages"]
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["kv_transfer_params"]["do_remote_prefill"] is False
    assert "max_completion_tokens" not in orjson.loads(disagg.nixl_prefill_body({"model": MODEL, "prompt": "x"}))


def test_the_nixl_decode_leg_is_the_clients_request_with_the_prefills_params() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [[1, 2]]}
    answer = orjson.dumps({"choices": [], "kv_transfer_params": params})
    got = disagg.nixl_transfer_params(answer)
    assert got == params
    body = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 9}
    assert orjson.loads(disagg.nixl_decode_body(body, got)) == {**body, "kv_transfer_params": params}
    for bad in (b"[]", b"{", orjson.dumps({"choices": []}), orjson.dumps({"kv_transfer_params": {"do_remote_prefill": False}})):
        with pytest.raises(ValueError):
            disagg.nixl_transfer_params(bad)


def test_bootstrap_legs_name_the_prefill_engine_and_a_fresh_room() -> None:
    p = _ep(7, Role.PREFILL, Handoff.BOOTSTRAP, 8998)
    body = {"model": MODEL, "prompt": "x"}
    a, b = (orjson.loads(disagg.bootstrap_body(body, p)) for _ in range(2))
    assert a["bootstrap_host"] == "10.0.0.7" and a["bootstrap_port"] == 8998 and a["prompt"] == "x"
    assert 0 <= a["bootstrap_room"] < 2**63 and a["bootstrap_room"] != b["bootstrap_room"]


# -- the engines' own protocol classes (pinned wheels, read, not imported) ----------------------


def _class_fields(source: str, name: str) -> set[str]:
    """Annotated field names of class ``name`` and of its bases defined in ``source``."""
    classes = {n.name: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)}
    fields: set[str] = set()
    todo = [name]
    while todo:
        cls = classes.get(todo.pop())
        if cls is None:
            continue
        fields |= {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
        todo += [b.id for b in cls.bases if isinstance(b, ast.Name)]
    return fields


def _got_keys(source: str) -> set[str]:
    """The keys a module reads with ``params.get("...")`` or ``params["..."]``."""
    keys = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args \
                and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str):
            keys.add(n.args[0].value)
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
            keys.add(n.slice.value)
    return keys


def test_vllm_legs_use_fields_of_vllms_own_requests_and_connector() -> None:
    chat = _class_fields(wheel_source("vllm", "vllm/entrypoints/openai/chat_completion/protocol.py"), "ChatCompletionRequest")
    completion = _class_fields(wheel_source("vllm", "vllm/entrypoints/openai/completion/protocol.py"), "CompletionRequest")
    for fields in (chat, completion):
        assert {"kv_transfer_params", "stream", "stream_options", "max_tokens"} <= fields
    assert "max_completion_tokens" in chat
    nixl = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/"
    read = _got_keys(wheel_source("vllm", nixl + "base_scheduler.py")) | _got_keys(wheel_source("vllm", nixl + "pull_scheduler.py"))
    # Every key the prefill leg sets is one the NixlConnector's scheduler reads.
    leg = orjson.loads(disagg.nixl_prefill_body({"model": MODEL, "prompt": "x"}))["kv_transfer_params"]
    assert set(leg) <= read, set(leg) - read


def test_sglang_legs_use_fields_of_sglangs_own_requests() -> None:
    source = wheel_source("sglang", "sglang/srt/entrypoints/openai/protocol.py")
    leg = orjson.loads(disagg.bootstrap_body({"model": MODEL}, _ep(1, Role.PREFILL, Handoff.BOOTSTRAP, 9000)))
    for cls in ("CompletionRequest", "ChatCompletionRequest"):
        assert {"bootstrap_host", "bootstrap_port", "bootstrap_room"} <= _class_fields(source, cls)
    assert {"bootstrap_host", "bootstrap_port", "bootstrap_room"} <= set(leg)


# -- through emulated engines -----------------------------------------------------------------


@contextmanager
def pd_fleet(replica: Replica, handoff: Handoff, prefill: int = 2, decode: int = 2, **options: Any
             ) -> Iterator[tuple[Served, list[Emulator], list[Emulator]]]:
    """``prefill`` + ``decode`` emulated engines of ``handoff`` behind a gateway."""
    with ExitStack() as stack:
        ps, ds, roles = [], [], []
        for _ in range(prefill):
            extra = ["--bootstrap-port", str(port := free_port())] if handoff is Handoff.BOOTSTRAP else []
            emu = start_emulator("--model", MODEL, "--role", "prefill", "--handoff", handoff.value,
                                 "--prefill-ms-per-token", "0.2", *extra)
            stack.callback(stop_emulator, emu)
            ps.append(emu)
            roles.append({"role": "prefill", "handoff": handoff.value,
                          "bootstrap_port": port if handoff is Handoff.BOOTSTRAP else None})
        for _ in range(decode):
            emu = start_emulator("--model", MODEL, "--role", "decode", "--handoff", handoff.value)
            stack.callback(stop_emulator, emu)
            ds.append(emu)
            roles.append({"role": "decode", "handoff": handoff.value})
        served = stack.enter_context(serving(replica, [e.url for e in ps + ds], roles=roles, **options))
        yield served, ps, ds


def _no_load_left(replica: Replica, served: Served, engines: list[Emulator]) -> None:
    wait_until(lambda: all(load_of(replica, w) == 0 for w in served.ids), "load left on a worker")
    wait_until(lambda: all(e.metric("vllm:num_requests_running") == 0 and e.metric("vllm:num_requests_waiting") == 0
                           for e in engines), "a request left running on an engine")


def _ask(client: openai.OpenAI, stream: bool, chat: bool, text: str) -> tuple[str, Any]:
    if chat:
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=8,
                                             stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
    else:
        out = client.completions.create(model=MODEL, prompt=text, max_tokens=8, stream=stream,
                                        **({"stream_options": {"include_usage": True}} if stream else {}))
    if not stream:
        choice = out.choices[0]
        return (choice.message.content if chat else choice.text) or "", out.usage
    text_out, usage = "", None
    for chunk in out:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text_out += (c.delta.content if chat else c.text) or ""
    return text_out, usage


@pytest.mark.parametrize("handoff", [Handoff.NIXL, Handoff.BOOTSTRAP])
def test_the_sdk_gets_answers_through_a_prefill_decode_fleet(replica: Replica, handoff: Handoff) -> None:
    with pd_fleet(replica, handoff) as (served, ps, ds):
        client = served.client()
        prompt = "a shared document about the routing of disaggregated requests " * 20
        for i, (stream, chat) in enumerate([(False, False), (True, False), (False, True), (True, True)] * 2):
            text, usage = _ask(client, stream, chat, prompt + str(i))
            assert text, (stream, chat)
            assert usage is not None and usage.completion_tokens == 8 and usage.prompt_tokens > 100
        # Every prefill leg on a prefill engine, every decode leg's prompt moved, not computed.
        assert sum(e.metric("vllm:prompt_tokens_total") for e in ps) > 0
        assert sum(e.metric("kvstream_emulator_kv_transfer_received_tokens_total") for e in ds) > 0
        assert sum(e.metric("vllm:generation_tokens_total") for e in ds) == 8 * 8
        _no_load_left(replica, served, ps + ds)
        # Prefill rates are learned from the prefill legs alone: a decode leg's first token
        # follows a transfer, not a prefill.
        with replica.lock:
            learned = {k.worker_id for k, rate in replica.router.learned_rates().per_worker.items() if rate}
        assert learned and learned <= set(served.ids[:len(ps)])


def test_a_prefix_goes_back_to_the_prefill_worker_that_holds_it(replica: Replica) -> None:
    with pd_fleet(replica, Handoff.NIXL, prefill=2, decode=1) as (served, ps, ds):
        client = served.client()
        shared = "the same long system prompt, every turn " * 40
        first = client.completions.with_raw_response.create(model=MODEL, prompt=shared + "turn 1", max_tokens=2)
        holder = first.headers["x-kvstream-prefill-worker"]
        # The prefill engine's KV events reach the index only through a worker bridge; the
        # prediction of the routed blocks (issue 33) is what sends the next turn back.
        for turn in range(2, 6):
            again = client.completions.with_raw_response.create(model=MODEL, prompt=shared + f"turn {turn}", max_tokens=2)
            assert again.headers["x-kvstream-prefill-worker"] == holder
            assert int(again.headers["x-kvstream-cached-tokens"]) > 0
        # The accuracy metrics compare the prediction with the prefill engine's own count
        # (the decode engine's is of the KV it was sent: nearly the whole prompt).
        predicted = metric(served, "kvstream_gateway_predicted_cached_tokens_total")
        assert 0 < predicted == metric(served, "kvstream_gateway_engine_cached_tokens_total")
        _no_load_left(replica, served, ps + ds)


@pytest.mark.parametrize("handoff", [Handoff.NIXL, Handoff.BOOTSTRAP])
def test_a_dead_prefill_worker_costs_no_request(replica: Replica, handoff: Handoff) -> None:
    with pd_fleet(replica, handoff, prefill=2, decode=1, retries=1) as (served, ps, ds):
        stop_emulator(ps[0])  # its port now refuses: every leg sent there goes to the other
        client = served.client()
        for i in range(6):
            text, _ = _ask(client, i % 2 == 0, False, f"request {i} " * 30)
            assert text
        # The dead one was tried (and its failure counted against it), then left out.
        assert metric(served, "kvstream_gateway_upstream_failures_total", worker=str(served.ids[0])) >= 1
        _no_load_left(replica, served, ps[1:] + ds)


def test_a_decode_worker_killed_mid_stream_fails_only_its_own_requests(replica: Replica) -> None:
    with pd_fleet(replica, Handoff.NIXL, prefill=1, decode=1) as (served, ps, ds):
        client = served.client()
        stream = client.completions.create(model=MODEL, prompt="a long answer " * 30, max_tokens=2000, stream=True)
        next(iter(stream))
        ds[0].proc.kill()
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        # The prefill side still answers; the next request finds no decode worker and says so.
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=MODEL, prompt="after", max_tokens=2)
        assert err.value.status_code in (502, 503)
        _no_load_left(replica, served, ps)


def test_a_client_that_leaves_cancels_both_legs(replica: Replica) -> None:
    with pd_fleet(replica, Handoff.BOOTSTRAP, prefill=1, decode=1) as (served, ps, ds):
        client = served.client()
        stream = client.completions.create(model=MODEL, prompt="going away " * 30, max_tokens=5000, stream=True)
        next(iter(stream))
        stream.close()
        _no_load_left(replica, served, ps + ds)


@pytest.mark.parametrize("handoff", [Handoff.NIXL, Handoff.BOOTSTRAP])
def test_both_legs_are_routed_without_a_decode_delay(replica: Replica, handoff: Handoff,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """ttft charges a prompt the delay its prefill puts on the requests decoding beside it;
    neither leg puts any (a prefill worker's requests decode elsewhere, a decode worker
    receives the KV by transfer), so both are routed with that weight at 0."""
    weights: list[float] = []
    route = replica.route

    def recorded(*args: Any, **kwargs: Any) -> Any:
        decision = route(*args, **kwargs)
        weights.append(decision.schedule.config.ttft_decode_delay_weight)
        return decision

    monkeypatch.setattr(replica, "route", recorded)
    with pd_fleet(replica, handoff, prefill=1, decode=1) as (served, ps, ds):
        served.client().completions.create(model=MODEL, prompt="one prompt, two legs " * 10, max_tokens=2)
        _no_load_left(replica, served, ps + ds)
    assert weights == [0.0, 0.0]
