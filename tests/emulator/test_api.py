"""``kvstream emulate`` through the official ``openai`` SDK and plain HTTP: vLLM's response
shapes, usage with cached tokens from the prefix cache, its error body, /metrics."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Callable

import openai
import pytest

from .conftest import Emulator

PROMPT = list(range(1000, 1000 + 100))  # token ids: 6 full blocks of 16 and 4 tokens


@pytest.fixture
def emu(emulator_factory: Callable[..., Emulator]) -> Emulator:
    return emulator_factory("--speed", "20", "--max-model-len", "4096", "--model", "emu-model")


def client(emu: Emulator) -> openai.OpenAI:
    return openai.OpenAI(base_url=emu.url + "/v1", api_key="none", max_retries=0)


def test_completion_and_cached_tokens_rise_on_a_repeat(emu: Emulator) -> None:
    c = client(emu)
    first = c.completions.create(model="emu-model", prompt=PROMPT, max_tokens=7)
    assert first.object == "text_completion" and first.model == "emu-model" and first.id.startswith("cmpl-")
    assert first.choices[0].finish_reason == "length" and first.choices[0].text
    assert first.usage is not None and first.usage.prompt_tokens == 100 and first.usage.completion_tokens == 7
    assert first.usage.total_tokens == 107
    assert first.usage.prompt_tokens_details is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    again = c.completions.create(model="emu-model", prompt=PROMPT, max_tokens=3)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 96  # the 6 full prompt blocks
    # A prompt sharing the first 3 blocks only.
    other = c.completions.create(model="emu-model", prompt=PROMPT[:48] + [7] * 40, max_tokens=1)
    assert other.usage is not None and other.usage.prompt_tokens_details.cached_tokens == 48  # type: ignore[union-attr]


def test_streaming_completion_with_usage(emu: Emulator) -> None:
    stream = client(emu).completions.create(model="emu-model", prompt="one two three four", max_tokens=40,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text_chunks = [ch for ch in chunks if ch.choices]
    assert text_chunks and all(ch.object == "text_completion" for ch in chunks)
    assert [ch.choices[0].finish_reason for ch in text_chunks][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 40 and chunks[-1].usage.prompt_tokens == 4
    assert len({ch.id for ch in chunks}) == 1


def test_chat_streaming_and_not(emu: Emulator) -> None:
    c = client(emu)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    whole = c.chat.completions.create(model="emu-model", messages=messages, max_tokens=5)  # type: ignore[arg-type]
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "length" and whole.usage is not None
    assert whole.usage.completion_tokens == 5
    chunks = list(c.chat.completions.create(model="emu-model", messages=messages, max_tokens=5,  # type: ignore[arg-type]
                                            stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # Without include_usage the stream carries no usage chunk.
    plain = list(c.chat.completions.create(model="emu-model", messages=messages, max_tokens=2, stream=True))  # type: ignore[arg-type]
    assert all(ch.choices for ch in plain) and all(ch.usage is None for ch in plain)


def test_sse_ends_with_done(emu: Emulator) -> None:
    req = urllib.request.Request(emu.url + "/v1/completions", data=b'{"prompt": "a b", "max_tokens": 3, "stream": true}',
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in resp.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"prompt": list(range(5000)), "max_tokens": 1}, "input_tokens"),
    ("/v1/completions", {"max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "kv_transfer_params": "yes"}, "kv_transfer_params"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/v1/completions/render", {"prompt": {"a": 1}}, "prompt"),
])
def test_malformed_requests_get_vllms_error(emu: Emulator, path: str, body: dict, param: str) -> None:
    status, answer = emu.post(path, body)
    assert status == 400, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["type"] == "BadRequestError" and answer["error"]["code"] == 400
    assert answer["error"]["param"] == param and answer["error"]["message"]


def test_bad_json_unknown_model_and_the_sdk_error(emu: Emulator) -> None:
    status, answer = emu.post("/v1/completions", None, raw=b"{not json")
    assert status == 400 and answer["error"]["type"] == "BadRequestError"
    status, answer = emu.post("/v1/completions", None, raw=b"[1, 2]")
    assert status == 400
    status, answer = emu.post("/v1/completions", {"model": "other", "prompt": "x"})
    assert status == 404 and answer["error"]["type"] == "NotFoundError"
    with pytest.raises(openai.BadRequestError) as err:
        client(emu).completions.create(model="emu-model", prompt="x", max_tokens=99999)
    assert "maximum context length is 4096" in str(err.value)
    emu.get("/health")  # still serving


def test_tokenize_render_models(emu: Emulator) -> None:
    status, tok = emu.post("/tokenize", {"prompt": "alpha beta gamma"})
    assert status == 200 and set(tok) >= {"count", "max_model_len", "tokens"}
    assert tok["count"] == len(tok["tokens"]) == 3 and tok["max_model_len"] == 4096
    status, rendered = emu.post("/v1/completions/render", {"model": "emu-model", "prompt": "alpha beta gamma",
                                                           "max_tokens": 9})
    assert status == 200 and isinstance(rendered, list) and len(rendered) == 1
    assert rendered[0]["token_ids"] == tok["tokens"] and rendered[0]["request_id"].startswith("cmpl-")
    assert rendered[0]["sampling_params"]["max_tokens"] == 9
    messages = [{"role": "user", "content": "alpha"}]
    status, chat = emu.post("/v1/chat/completions/render", {"messages": messages})
    _, chat_tok = emu.post("/tokenize", {"messages": messages})
    assert status == 200 and chat["token_ids"] == chat_tok["tokens"] and chat["request_id"].startswith("chatcmpl-")
    assert json.loads(emu.get("/version")) == {"version": "0.33.0"} and emu.get("/ping") == ""
    models = client(emu).models.list()
    assert [m.id for m in models.data] == ["emu-model"] and models.data[0].owned_by == "vllm"


def test_metrics_have_vllms_names_and_move(emu: Emulator) -> None:
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
             "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
             "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total")
    before = {n: emu.metric(n) for n in names}
    assert before["vllm:prefix_cache_queries_total"] == 0
    c = client(emu)
    for _ in range(2):
        c.completions.create(model="emu-model", prompt=PROMPT, max_tokens=4)
    after = {n: emu.metric(n) for n in names}
    assert after["vllm:prefix_cache_queries_total"] == 200
    assert after["vllm:prefix_cache_hits_total"] == 96
    assert after["vllm:prompt_tokens_total"] == 200
    assert after["vllm:generation_tokens_total"] == 8
    assert after["vllm:time_to_first_token_seconds_count"] == 2
    assert after["vllm:request_success_total"] == 2
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    text = emu.get("/metrics")
    assert 'model_name="emu-model"' in text and 'engine="0"' in text


def test_a_client_that_goes_away_aborts_its_request(emulator_factory: Callable[..., Emulator]) -> None:
    emu = emulator_factory("--speed", "1", "--max-model-len", "4096")
    for stream in (True, False):
        body = f'{{"prompt": [1, 2, 3, 4], "max_tokens": 4000, "stream": {str(stream).lower()}}}'.encode()
        with socket.create_connection(("127.0.0.1", emu.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.monotonic() + 10
            while emu.metric("vllm:num_requests_running") != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        # 4,000 tokens would take 20 s; gone, the request is dropped and its blocks freed.
        deadline = time.monotonic() + 10
        while emu.metric("vllm:num_requests_running") or emu.metric("vllm:kv_cache_usage_perc"):
            assert time.monotonic() < deadline, f"stream={stream}: the request kept running"
            time.sleep(0.05)
    assert emu.metric("vllm:request_success_total") == 0
    status, _ = emu.post("/v1/completions", {"prompt": "still serving", "max_tokens": 2})
    assert status == 200
