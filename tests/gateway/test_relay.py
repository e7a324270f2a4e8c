"""The gateway of a replica, driven by the official openai SDK (and raw HTTP where the
bytes matter), through a real broker, against real HTTP backends (tests/gateway/backends.py)."""

from __future__ import annotations

import ast
import random
import threading
import time

import httpx
import openai
import orjson
import pytest
from engines.engines import wheel_source

from kvstream.gateway.options import ModelTokenizerConfig
from kvstream.gateway.tokenize import LocalTokenizer, load
from kvstream.replica.options import ReplicaOptions
from kvstream.replica.replica import Replica
from kvstream.settings import Settings
from tests.gateway.backends import Backend, closed_port, running
from tests.gateway.fleet import (
    LORA,
    MODEL,
    TOKEN,
    load_of,
    publish_prefix,
    serving,
    tokenizer_file,
    wait_until,
)
from tests.replica.test_replica_kafka import start

pytestmark = pytest.mark.kafka
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def ids(seed: int, blocks: int = 4) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(16 * blocks)]


def metric(served, name: str, **labels: str) -> float:
    text = httpx.get(f"{served.base_url}/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            got = line[len(name):].split(" ")[0]
            if all(f'{k}="{v}"' in got for k, v in labels.items()) or not want:
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_streamed_and_whole_answers_reach_the_sdk_and_load_returns_to_zero(replica: Replica, prompt_tokenizer) -> None:
    with running(Backend("a", chunks=5, cached_tokens=32)) as (a,), serving(replica, [a], {MODEL: prompt_tokenizer}) as s:
        client = s.client()
        chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", stream=True, max_tokens=5,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == "t0 t1 t2 t3 t4 "
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
        whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert whole.choices[0].message.content == "t0 t1 t2 t3 t4 "
        streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "t0 t1 t2 t3 t4 "
        # The text prompt was routed by the test tokenizer's ids.
        assert orjson.loads(a.requests("/v1/completions")[0].body)["prompt"] == "Once upon a time"
        wait_until(lambda: load_of(replica, s.ids[0]) == 0, "the load of finished requests was not freed")
        assert metric(s, "kvstream_gateway_requests_total", model=MODEL, endpoint="/v1/completions", status="200") == 1
        assert metric(s, "kvstream_gateway_requests_total", model=MODEL, endpoint="/v1/chat/completions", status="200") == 2
        assert metric(s, "kvstream_gateway_engine_cached_tokens_total", model=MODEL) == 2 * 32  # the two answers that reported usage
        assert metric(s, "kvstream_gateway_ttft_seconds_count", model=MODEL) == 3
        # The ttft policy learned prefill rates from the first-token times.
        with replica.lock:
            learned = replica.router.learned_rates()
        assert learned.fleet is not None
        # ...which /metrics shows, with the model's error (each prediction against its observation).
        assert metric(s, "kvstream_ttft_prefill_tokens_per_second") == pytest.approx(learned.fleet, rel=1e-6)
        assert metric(s, "kvstream_ttft_model_error") == pytest.approx(learned.error, rel=1e-6)


def test_body_is_forwarded_byte_for_byte_and_headers_are_filtered(replica: Replica) -> None:
    raw = ('{ "prompt":[1, 2,3],\n "model" : "m", "kv_transfer_params": {"do_remote_decode": true, "x": [1e3]},'
           ' "unicode": "caf\\u00e9 \u2603", "max_tokens": 2 }').encode()
    with running(Backend("a", chunks=2)) as (a,), serving(replica, [a], api_keys={0: "worker-key"}) as s:
        r = httpx.post(f"{s.base_url}/v1/completions", content=raw, headers={
            **AUTH, "content-type": "application/json", "x-request-id": "req-42", "x-custom": "kept",
            "connection": "keep-alive, x-drop-me", "x-drop-me": "1", "te": "trailers",
        })
        assert r.status_code == 200, r.text
        got = a.requests("/v1/completions")[-1]
        assert got.body == raw
        h = got.headers
        assert h["x-request-id"] == "req-42" and h["x-custom"] == "kept"
        assert h["authorization"] == "Bearer worker-key"  # the worker's key, never the client's
        assert TOKEN not in str(got.headers)
        assert "x-drop-me" not in h and "te" not in h
        assert r.headers["x-request-id"] == "req-42"
        assert r.headers["x-kvstream-worker"] == str(s.ids[0])
        assert r.headers["x-kvstream-cached-tokens"] == "0"
        assert r.headers["x-engine"] == "a"  # the engine's own headers come back
        assert "x-data-parallel-rank" not in h  # one rank: the engine's own choice
        # A rank the index knows of the worker is a candidate, and the engine is told it.
        publish_prefix(replica, s.ids[0], ids(12), rank=1)
        r = httpx.post(f"{s.base_url}/v1/completions", json={"model": MODEL, "prompt": ids(12)},
                       headers={**AUTH, "x-data-parallel-rank": "0"})
        assert r.headers["x-kvstream-cached-tokens"] == str(len(ids(12)))
        assert a.requests()[-1].headers["x-data-parallel-rank"] == "1"
        # With the SDK: an engine field it does not know reaches the worker; a minted id comes back.
        resp = s.client().completions.with_raw_response.create(
            model=MODEL, prompt=[5, 6], extra_body={"kv_transfer_params": {"remote_block_ids": [1, 2]}})
        assert orjson.loads(a.requests()[-1].body)["kv_transfer_params"] == {"remote_block_ids": [1, 2]}
        assert resp.headers["x-request-id"] == a.requests()[-1].headers["x-request-id"]
        # Without a token of the client scope: refused, in OpenAI's form.
        with pytest.raises(openai.AuthenticationError) as err:
            openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="wrong", max_retries=0).completions.create(model=MODEL, prompt="x")
        assert err.value.code == "invalid_api_key"


def test_stream_is_relayed_as_it_arrives(replica: Replica) -> None:
    gate = threading.Event()
    with running(Backend("a", chunks=3, gate=gate)) as (a,), serving(replica, [a]) as s:
        stream = s.client().completions.create(model=MODEL, prompt=ids(1), stream=True)
        it = iter(stream)
        first = next(it)  # the backend holds the rest until the gate opens
        assert first.choices[0].text == "t0 "
        assert not gate.is_set() and len(a.sent_at[0]) == 1, "the first chunk came only after the backend finished"
        assert load_of(replica, s.ids[0]) == 1  # routed, prefill done, not yet freed
        gate.set()
        assert [c.choices[0].text for c in it] == ["t1 ", "t2 "]
        wait_until(lambda: load_of(replica, s.ids[0]) == 0, "the load was not freed at the end of the stream")


def test_peer_replicas_see_the_load_of_relayed_requests(replica: Replica, kafka_topics) -> None:
    """The gateway's load ops reach the other replicas through kvstream.active, in order:
    the peer counts the request while it streams and forgets it at its end."""
    peer = start(kafka_topics)
    gate = threading.Event()
    try:
        with running(Backend("a", chunks=2, gate=gate)) as (a,), serving(replica, [a]) as s:
            stream = iter(s.client().completions.create(model=MODEL, prompt=ids(9), stream=True))
            next(stream)
            wait_until(lambda: load_of(peer, s.ids[0]) == 1, "the peer never saw the relayed request's load")
            gate.set()
            list(stream)
            wait_until(lambda: load_of(peer, s.ids[0]) == 0, "the peer kept the load of a finished request")
            # A request that fails before its first byte leaves nothing behind either.
            a.mode = "fail"
            with pytest.raises(openai.InternalServerError):
                s.client().completions.create(model=MODEL, prompt=ids(10))
            time.sleep(0.5)
            assert load_of(peer, s.ids[0]) == 0
            with peer.lock:
                assert peer.metrics.active_errors._metrics == {}  # no op arrived out of order
    finally:
        peer.stop()


def test_client_disconnect_cancels_upstream_and_frees_the_load(replica: Replica) -> None:
    with running(Backend("a", chunks=400, delay_s=0.02)) as (a,), serving(replica, [a]) as s:
        stream = s.client().completions.create(model=MODEL, prompt=ids(2), stream=True)
        it = iter(stream)
        next(it), next(it)
        assert load_of(replica, s.ids[0]) == 1
        stream.close()
        wait_until(lambda: a.cancelled == 1, "the backend never saw the request cancelled")
        wait_until(lambda: load_of(replica, s.ids[0]) == 0, "the load of a disconnected client was not freed")
        assert a.completed == 0
        wait_until(lambda: metric(s, "kvstream_gateway_requests_total", status="499") == 1, "the disconnect was not counted")


def test_error_after_the_first_byte_ends_the_stream_with_an_error_event(replica: Replica) -> None:
    with running(Backend("a", chunks=6, mode="break")) as (a,), serving(replica, [a]) as s:
        stream = s.client().completions.create(model=MODEL, prompt=ids(3), stream=True)
        texts = []
        with pytest.raises(openai.APIError, match="stream broke off"):
            for c in stream:
                texts.append(c.choices[0].text)
        assert texts == ["t0 ", "t1 "]
        wait_until(lambda: load_of(replica, s.ids[0]) == 0, "the load of a broken stream was not freed")


def test_failure_before_the_first_byte_retries_on_a_different_worker(replica: Replica) -> None:
    prompt = ids(4)
    with running(Backend("dead", mode="fail"), Backend("b")) as (dead, b), \
            serving(replica, [dead, f"http://127.0.0.1:{closed_port()}", b], retries=2) as s:
        dead_id, gone_id, b_id = s.ids
        publish_prefix(replica, dead_id, prompt)  # the cache is on the failing worker...
        publish_prefix(replica, gone_id, prompt[:32])  # ...and some on the one with no engine
        r = s.client().completions.with_raw_response.create(model=MODEL, prompt=prompt)
        assert r.headers["x-kvstream-worker"] == str(b_id)
        assert len(dead.requests()) == 1  # tried once, never again for this request
        assert metric(s, "kvstream_gateway_retries_total") == 2
        for wid in s.ids:
            wait_until(lambda wid=wid: load_of(replica, wid) == 0, f"worker {wid} kept a failed attempt's load")


def test_with_no_other_worker_left_the_engines_own_5xx_is_the_answer(replica: Replica) -> None:
    prompt = ids(4)
    with running(Backend("dead", mode="fail")) as (dead,), serving(replica, [dead], retries=2) as s:
        with pytest.raises(openai.InternalServerError) as err:
            s.client().completions.create(model=MODEL, prompt=prompt)
        assert err.value.status_code == 500 and len(dead.requests()) == 1
        assert err.value.response.headers["x-kvstream-worker"] == str(s.ids[0])


def test_a_worker_that_sends_nothing_times_out_and_the_request_goes_elsewhere(replica: Replica) -> None:
    prompt = ids(8)
    with running(Backend("stuck", mode="hang"), Backend("b")) as (stuck, b), \
            serving(replica, [stuck, b], read_timeout_s=0.5) as s:
        publish_prefix(replica, s.ids[0], prompt)
        r = s.client().completions.with_raw_response.create(model=MODEL, prompt=prompt, stream=True)
        assert r.headers["x-kvstream-worker"] == str(s.ids[1])
        assert [c.choices[0].text for c in r.parse()] == ["t0 ", "t1 ", "t2 ", "t3 "]
        assert len(stuck.requests()) == 1
        assert metric(s, "kvstream_gateway_retries_total", reason="timeout") == 1
        wait_until(lambda: load_of(replica, s.ids[0]) == load_of(replica, s.ids[1]) == 0, "load left behind")


@pytest.mark.parametrize("mode", ["engine", "auto"])
def test_text_is_tokenized_by_one_engine_when_asked(replica: Replica, prompt_tokenizer, mode: str) -> None:
    """``engine``, and ``auto`` (the default) for a model with no local tokenizer: text
    works at first contact, as with every peer router."""
    text = "A prompt that only the engines can tokenize, long enough for blocks. " * 6
    token_ids = prompt_tokenizer.completion_ids(text)
    engines = [Backend(n, tokenize=prompt_tokenizer.completion_ids) for n in "abc"]
    opts = {} if mode == "auto" else {"tokenize": mode}
    with running(*engines) as backends, serving(replica, backends, **opts) as s:
        publish_prefix(replica, s.ids[2], token_ids)
        r = s.client().completions.with_raw_response.create(model=MODEL, prompt=text)
        assert r.headers["x-kvstream-worker"] == str(s.ids[2])
        assert r.headers["x-kvstream-cached-tokens"] == str(len(token_ids) // 16 * 16)
        asked = [b for b in backends if b.requests("/tokenize")]
        assert len(asked) == 1 and len(asked[0].requests("/tokenize")) == 1
        assert orjson.loads(asked[0].requests("/tokenize")[0].body) == {"model": MODEL, "prompt": text}


def test_tokenizing_moves_on_from_an_engine_that_is_down(replica: Replica, prompt_tokenizer) -> None:
    """The fleet bench's killed engine: its bridge still heartbeats, so it is still a
    candidate; tokenizing must not fail the request there."""
    text = "A prompt for an engine that died a moment ago, long enough for blocks. " * 6
    token_ids = prompt_tokenizer.completion_ids(text)
    alive = Backend("alive", tokenize=prompt_tokenizer.completion_ids)
    with running(alive) as (b,), serving(replica, ["http://127.0.0.1:9", b], tokenize="engine") as s:
        publish_prefix(replica, s.ids[1], token_ids)
        r = s.client().completions.with_raw_response.create(model=MODEL, prompt=text)
        assert r.headers["x-kvstream-worker"] == str(s.ids[1])
        assert len(b.requests("/tokenize")) == 1


def _prompt_sent(backend: Backend, n: int = -1) -> object:
    return orjson.loads(backend.requests("/v1/completions")[n].body)["prompt"]


def test_a_text_prompt_goes_as_the_ids_it_was_routed_by_once_an_engine_agrees(replica: Replica, prompt_tokenizer) -> None:
    """The engine does not tokenize again what the gateway did (``send_token_ids``): the
    local tokenizer's ids replace the text once one engine's /tokenize gave the same ids,
    asked once; echo, ``add_special_tokens: false`` and chat keep what the client sent."""
    text = "An agent's long context, tokenized once at the gateway. " * 8
    want = list(prompt_tokenizer.completion_ids(text))
    with running(Backend("a", chunks=3, tokenize=prompt_tokenizer.completion_ids)) as (a,), \
            serving(replica, [a], {MODEL: prompt_tokenizer}) as s:
        client = s.client()
        first = client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0.5)
        streamed = list(client.completions.create(model=MODEL, prompt=text, max_tokens=3, stream=True))
        assert first.choices[0].text == "t0 t1 t2 "
        assert "".join(c.choices[0].text for c in streamed if c.choices) == "t0 t1 t2 "
        assert len(a.requests("/tokenize")) == 1  # the check, once
        for n in (0, 1):
            body = orjson.loads(a.requests("/v1/completions")[n].body)
            assert body["prompt"] == want and body["model"] == MODEL and body["max_tokens"] == 3
        assert orjson.loads(a.requests("/v1/completions")[0].body)["temperature"] == 0.5
        assert orjson.loads(a.requests("/v1/completions")[1].body)["stream"] is True
        client.completions.create(model=MODEL, prompt=text, max_tokens=3, echo=True)
        assert _prompt_sent(a) == text
        client.completions.create(model=MODEL, prompt=text, max_tokens=3, extra_body={"add_special_tokens": False})
        assert _prompt_sent(a) == text
        client.completions.create(model=MODEL, prompt=[text], max_tokens=3)  # a batch goes as it is
        assert _prompt_sent(a) == [text]
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}])
        assert orjson.loads(a.requests("/v1/chat/completions")[-1].body)["messages"][0]["content"] == text
        assert len(a.requests("/tokenize")) == 1


@pytest.mark.parametrize("case", ["disagrees", "fails", "off"])
def test_a_local_tokenizer_no_engine_confirms_sends_text(replica: Replica, prompt_tokenizer, case: str) -> None:
    """Ids the engine would not have made never replace the text: an engine whose
    /tokenize disagrees, one that fails (asked again only after a while), or the setting off."""
    text = "A prompt whose ids the engine must agree with first. " * 4
    backend = Backend(case, tokenize=None if case == "fails" else  # no tokenizer: its /tokenize answers 500
                      lambda t: [7] * len(prompt_tokenizer.completion_ids(t)) if case == "disagrees" else None)
    options = {"send_token_ids": False} if case == "off" else {}
    with running(backend) as (b,), serving(replica, [b], {MODEL: prompt_tokenizer}, **options) as s:
        for _ in range(3):
            s.client().completions.create(model=MODEL, prompt=text, max_tokens=2)
        assert [_prompt_sent(b, n) for n in range(3)] == [text] * 3
        assert len(b.requests("/tokenize")) == (0 if case == "off" else 1)


def test_an_engines_own_ids_replace_the_text_with_no_second_question(replica: Replica, prompt_tokenizer) -> None:
    text = "Engines tokenize this one, and then need not again. " * 4
    with running(Backend("a", tokenize=prompt_tokenizer.completion_ids)) as (a,), serving(replica, [a], tokenize="engine") as s:
        for _ in range(2):
            s.client().completions.create(model=MODEL, prompt=text, max_tokens=2)
        assert len(a.requests("/tokenize")) == 2  # one per request: to route it
        assert _prompt_sent(a, 0) == _prompt_sent(a, 1) == list(prompt_tokenizer.completion_ids(text))


def test_the_fields_the_ids_rule_reads_are_the_engines_own() -> None:
    """vLLM and SGLang take a completions prompt as token ids, and name ``echo`` and
    (vLLM) ``add_special_tokens`` as read here (their protocol classes, pinned wheels)."""
    vllm = ast_class(wheel_source("vllm", "vllm/entrypoints/openai/completion/protocol.py"), "CompletionRequest")
    sglang = ast_class(wheel_source("sglang", "sglang/srt/entrypoints/openai/protocol.py"), "CompletionRequest")
    assert {"prompt", "echo", "add_special_tokens"} <= set(vllm) and {"prompt", "echo"} <= set(sglang)
    assert "list[Annotated[int" in vllm["prompt"].replace(" ", "") or "list[int]" in vllm["prompt"]
    assert "List[int]" in sglang["prompt"]


def ast_class(source: str, name: str) -> dict[str, str]:
    """Field name → its annotation's source, of class ``name`` in ``source``."""
    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name)
    return {s.target.id: ast.unparse(s.annotation) for s in cls.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def test_the_engines_own_4xx_comes_back_as_it_is_and_is_not_retried(replica: Replica) -> None:
    with running(Backend("a", mode="reject"), Backend("b", mode="reject")) as (a, b), serving(replica, [a, b]) as s:
        with pytest.raises(openai.BadRequestError) as err:
            s.client().completions.create(model=MODEL, prompt=ids(11), stream=True)
        assert err.value.body["message"] == "too long"
        assert len(a.requests()) + len(b.requests()) == 1
        assert metric(s, "kvstream_gateway_retries_total") == 0
        assert all(metric(s, "kvstream_gateway_breaker_state", worker=str(w)) == 0 for w in s.ids)
        wait_until(lambda: all(load_of(replica, w) == 0 for w in s.ids), "load left behind")


def test_breaker_opens_after_failures_and_closes_after_a_trial(replica: Replica) -> None:
    prompt = ids(5)
    with running(Backend("a", mode="fail"), Backend("b")) as (a, b), \
            serving(replica, [a, b], breaker_failures=2, breaker_cooldown_s=0.5) as s:
        a_id, b_id = s.ids
        client = s.client()
        # Each prompt is held by a alone (one that b served is expected on b after it).
        longer = prompt + ids(50)
        publish_prefix(replica, a_id, prompt, also=(ids(51), ids(52), longer))
        for p in (prompt, ids(51)):  # each fails over to b
            assert client.completions.with_raw_response.create(model=MODEL, prompt=p).headers["x-kvstream-worker"] == str(b_id)
        assert metric(s, "kvstream_gateway_breaker_state", worker=str(a_id)) == 1
        client.completions.create(model=MODEL, prompt=ids(52))
        assert len(a.requests()) == 2  # open: a is not tried though it holds the prefix
        a.mode = "ok"
        time.sleep(0.6)  # the cool-down: one trial may go to a
        assert client.completions.with_raw_response.create(model=MODEL, prompt=longer).headers["x-kvstream-worker"] == str(a_id)
        assert metric(s, "kvstream_gateway_breaker_state", worker=str(a_id)) == 0
        assert client.completions.with_raw_response.create(model=MODEL, prompt=longer).headers["x-kvstream-worker"] == str(a_id)


def test_active_health_takes_a_worker_out_until_it_recovers(replica: Replica) -> None:
    prompt = ids(6)
    with running(Backend("a", health=503), Backend("b")) as (a, b), \
            serving(replica, [a, b], health_interval_s=0.1, breaker_cooldown_s=0.3) as s:
        a_id, b_id = s.ids
        # b serves the prompt meanwhile (it is expected there then): a holds a longer one.
        longer = prompt + ids(60)
        publish_prefix(replica, a_id, prompt, also=(longer,))
        wait_until(lambda: metric(s, "kvstream_gateway_worker_up", worker=str(a_id)) == 0 and a.health_checks, "never probed")
        client = s.client()
        assert client.completions.with_raw_response.create(model=MODEL, prompt=prompt).headers["x-kvstream-worker"] == str(b_id)
        assert not a.requests()
        a.health = 200
        wait_until(lambda: metric(s, "kvstream_gateway_breaker_state", worker=str(a_id)) == 0, "a never recovered")
        assert client.completions.with_raw_response.create(model=MODEL, prompt=longer).headers["x-kvstream-worker"] == str(a_id)


def test_no_worker_up_is_503(replica: Replica) -> None:
    with serving(replica, [f"http://127.0.0.1:{closed_port()}"], health_interval_s=0.1) as s:
        wait_until(lambda: metric(s, "kvstream_gateway_worker_up", worker=str(s.ids[0])) == 0, "the dead worker stayed up")
        r = httpx.post(f"{s.base_url}/v1/completions", json={"model": MODEL, "prompt": [1, 2]}, headers=AUTH)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_worker_available"


def test_a_request_waits_for_a_replica_that_is_not_ready_yet(kafka_topics: Settings) -> None:
    # A restarted replica serves HTTP before it has caught up with the log: a request
    # that comes then is answered once it is ready instead of refused; one still waiting
    # after ready_wait_s is a 503 that says why.
    late = Replica(kafka_topics, ReplicaOptions(tick_interval_s=3600.0))
    never = Replica(kafka_topics, ReplicaOptions(tick_interval_s=3600.0))
    try:
        with running(Backend("a", chunks=2)) as (a,), serving(never, [a], ready_wait_s=0.3) as refusing, \
                serving(late, [a], ready_wait_s=60.0) as waiting:
            t0 = time.monotonic()
            r = httpx.post(f"{refusing.base_url}/v1/completions", json={"model": MODEL, "prompt": [1, 2]}, headers=AUTH)
            assert r.status_code == 503 and time.monotonic() - t0 >= 0.3
            assert "not ready" in r.json()["error"]["message"] and "waited 0.3s" in r.json()["error"]["message"]
            answers: list = []  # through the openai SDK, as a client waits
            sent = threading.Thread(target=lambda: answers.append(
                waiting.client().with_options(timeout=60).completions.create(model=MODEL, prompt=[1, 2])))
            sent.start()
            time.sleep(0.5)
            assert sent.is_alive() and not a.requests("/v1/completions"), "answered before the replica was ready"
            late.start()
            sent.join(60)
            assert answers and answers[0].choices[0].text == "t0 t1 "
            wait_until(lambda: load_of(late, waiting.ids[0]) == 0, "the waiting request's load was not freed")
    finally:
        late.stop()
        never.stop()


@pytest.mark.parametrize("limit", [{"max_inflight": 1}, {"max_inflight_per_worker": 1}])
def test_over_the_inflight_limit_is_429(replica: Replica, limit: dict) -> None:
    gate = threading.Event()
    with running(Backend("a", chunks=2, gate=gate)) as (a,), serving(replica, [a], retry_after_s=2, **limit) as s:
        client = s.client()
        stream = iter(client.completions.create(model=MODEL, prompt=[1, 2, 3], stream=True))
        next(stream)
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=MODEL, prompt=[1, 2, 3])
        assert err.value.response.headers["retry-after"] == "2"
        gate.set()
        list(stream)
        wait_until(lambda: s.gateway.inflight == 0, "the in-flight count did not come back to zero")
        client.completions.create(model=MODEL, prompt=[1, 2, 3])


def test_over_the_limit_a_request_waits_in_line_for_a_slot(replica: Replica) -> None:
    gate = threading.Event()
    with running(Backend("a", chunks=2, gate=gate)) as (a,), \
            serving(replica, [a], max_inflight=1, queue_timeout_s=0.3, max_queued=1) as s:
        client = s.client()
        stream = iter(client.completions.create(model=MODEL, prompt=[1, 2], stream=True))
        next(stream)
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError, match="none ended within"):
            client.completions.create(model=MODEL, prompt=[1, 2])
        assert time.monotonic() - t0 >= 0.3
        # A slot that frees while a request waits goes to it.
        waited: list[str] = []
        waiter = threading.Thread(target=lambda: waited.append(
            client.completions.create(model=MODEL, prompt=[3, 4]).choices[0].text))
        waiter.start()
        wait_until(lambda: metric(s, "kvstream_gateway_queued") == 1, "the request never queued")
        with pytest.raises(openai.RateLimitError):  # the line is full
            client.completions.create(model=MODEL, prompt=[5, 6])
        gate.set()
        list(stream)
        waiter.join(10)
        assert waited == ["t0 t1 "]
        wait_until(lambda: s.gateway.inflight == 0, "a slot was lost in the hand-over")


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b"{not json", 400, None, None),
        (b"[1, 2]", 400, None, None),
        (b'{"prompt": "x"}', 400, "model", None),
        (b'{"model": 3, "prompt": "x"}', 400, "model", None),
        (b'{"model": "nope", "prompt": "x"}', 404, "model", "model_not_found"),
        (b'{"model": "m"}', 400, "prompt", None),
        (b'{"model": "m", "prompt": {"a": 1}}', 400, "prompt", None),
        (b'{"model": "m", "prompt": [1, -2]}', 400, "prompt", None),
        (b'{"model": "m", "prompt": [1, "a"]}', 400, "prompt", None),
        (b'{"model": "m", "prompt": [1, 2], "stream": "yes"}', 400, "stream", None),
        (b'{"model": "m", "prompt": "no tokenizer for text"}', 400, "model", "no_tokenizer"),
        (b'{"model": "m", "prompt": [' + b",".join([b"7"] * 65) + b"]}", 400, "prompt", "context_length_exceeded"),
    ],
)
def test_bad_bodies_get_openai_errors(replica: Replica, body: bytes, status: int, param: str | None, code: str | None) -> None:
    with running(Backend("a")) as (a,), serving(replica, [a], max_prompt_tokens=64, tokenize="local") as s:
        r = httpx.post(f"{s.base_url}/v1/completions", content=body, headers=AUTH)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert (error["param"], error["code"]) == (param, code)
        assert not a.requests()
        chat = httpx.post(f"{s.base_url}/v1/chat/completions", json={"model": MODEL, "messages": "hi"}, headers=AUTH)
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        assert s.gateway.inflight == 0


@pytest.mark.parametrize("inline_tokenize_bytes", [16_384, 0])  # 0: every prompt tokenized in a thread
def test_the_worker_holding_the_longest_prefix_gets_the_request(replica: Replica, prompt_tokenizer, inline_tokenize_bytes: int) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 12
    token_ids = prompt_tokenizer.completion_ids(text)
    full = len(token_ids) // 16 * 16
    with running(Backend("a"), Backend("b"), Backend("c")) as backends, \
            serving(replica, backends, {MODEL: prompt_tokenizer}, inline_tokenize_bytes=inline_tokenize_bytes) as s:
        publish_prefix(replica, s.ids[0], token_ids[:32])
        publish_prefix(replica, s.ids[1], token_ids[:full])
        client = s.client()
        for _ in range(3):
            r = client.completions.with_raw_response.create(model=MODEL, prompt=text)
            assert r.headers["x-kvstream-worker"] == str(s.ids[1])
            assert r.headers["x-kvstream-cached-tokens"] == str(full)
        # As token ids, the same; the third worker has published nothing and still
        # takes a prompt nobody holds when the others are busier.
        r = client.completions.with_raw_response.create(model=MODEL, prompt=token_ids)
        assert r.headers["x-kvstream-worker"] == str(s.ids[1])
        assert metric(s, "kvstream_gateway_predicted_cached_tokens_total", model=MODEL) == 4 * full
        wait_until(lambda: all(load_of(replica, w) == 0 for w in s.ids), "load left behind")
        chosen = {client.completions.with_raw_response.create(model=MODEL, prompt=ids(seed)).headers["x-kvstream-worker"]
                  for seed in range(40, 52)}
        assert str(s.ids[2]) in chosen  # a registered worker with no event is a candidate


def test_a_long_document_is_routed_by_the_local_tokenizers_cached_ids(replica: Replica, prompt_tokenizer) -> None:
    """kvstream's own LocalTokenizer in the gateway: a long document's ids (a uint32 array,
    joined from its prefix cache the second time) route it to the worker holding it."""
    local = LocalTokenizer(load(ModelTokenizerConfig(name=MODEL, tokenizer=str(tokenizer_file()))))
    text = " ".join(f"part {i} of the document about the cache" for i in range(800)) + " What does it say?"
    token_ids = prompt_tokenizer.completion_ids(text)  # the tokenizer's own, the text whole
    full = len(token_ids) // 16 * 16
    with running(Backend("a"), Backend("b")) as backends, serving(replica, backends, {MODEL: local}) as s:
        publish_prefix(replica, s.ids[1], token_ids[:full])
        client = s.client()
        for _ in range(2):
            r = client.completions.with_raw_response.create(model=MODEL, prompt=text)
            assert r.headers["x-kvstream-worker"] == str(s.ids[1])
            assert r.headers["x-kvstream-cached-tokens"] == str(full)
        # The second came from the cache, all but the piece after its last word cut.
        assert local.cache is not None and local.cache.stats.hit_tokens > len(token_ids) * 0.9


def test_models_embeddings_and_lora_names(replica: Replica) -> None:
    with running(Backend("a"), Backend("b")) as (a, b), serving(replica, [a, b]) as s:
        client = s.client()
        assert [m.id for m in client.models.list()] == [MODEL, LORA]
        assert client.models.retrieve(LORA).model_extra["parent"] == MODEL
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("org/unknown")
        e = client.embeddings.with_raw_response.create(model=MODEL, input="hello")
        assert e.parse().data[0].embedding == [0.5, 0.25]
        assert e.headers["x-kvstream-worker"] in {str(w) for w in s.ids}
        assert len(a.requests("/v1/embeddings")) + len(b.requests("/v1/embeddings")) == 1
        # A LoRA adapter's name selects its workers and enters the block hashes.
        prompt = ids(7)
        publish_prefix(replica, s.ids[1], prompt, lora=LORA)
        r = client.completions.with_raw_response.create(model=LORA, prompt=prompt)
        assert r.headers["x-kvstream-worker"] == str(s.ids[1]) and r.headers["x-kvstream-cached-tokens"] == str(len(prompt))
        # The base model's name does not match the adapter's blocks.
        assert client.completions.with_raw_response.create(model=MODEL, prompt=prompt).headers["x-kvstream-cached-tokens"] == "0"
