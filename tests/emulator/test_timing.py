"""The emulator's time is the cost model's (kvstream.engine_model.costs): a long prompt's
chunked prefill and its decode take what the cost function predicts, divided by --speed;
a request arriving during a run of decode-only steps is admitted at the next step."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable

from kvstream.engine_model.costs import CostModel

from .conftest import Emulator

#: Slow enough that the request's own handling (JSON of 20k ids on a loaded 2-core
#: machine) is small against the modelled times.
SPEED = 2.0


def timed_stream(emu: Emulator, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT, end to end) in seconds as a plain HTTP client sees them (the SDK's own
    request building takes ~0.3 s for 20k token ids: not the engine's time)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True}).encode()
    req = urllib.request.Request(emu.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    start = time.monotonic()
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.readline().startswith(b"data: {")
        first = time.monotonic() - start
        assert resp.read().endswith(b"data: [DONE]\n\n")
    return first, time.monotonic() - start


def test_long_prompt_ttft_and_decode_follow_the_cost_model(emulator_factory: Callable[..., Emulator]) -> None:
    emu = emulator_factory("--speed", str(SPEED))
    cost = CostModel()
    n = 20_000  # 8192 + 8192 + 3616: three chunked-prefill steps
    chunks = [cost.max_batch_tokens, cost.max_batch_tokens, n - 2 * cost.max_batch_tokens]
    prefill_s = sum(cost.step_ms(c, 0, 0) for c in chunks) / 1000 / SPEED
    decode_s = cost.decode_steps_ms(199, 1, n) / 1000 / SPEED
    ttft, e2e = timed_stream(emu, list(range(n)), 200)
    assert prefill_s <= ttft <= prefill_s * 1.1 + 0.1, (ttft, prefill_s)
    assert decode_s * 0.95 <= e2e - ttft <= decode_s * 1.1 + 0.05, (e2e - ttft, decode_s)
    # The engine's own histogram saw the same first token.
    assert prefill_s <= emu.metric("vllm:time_to_first_token_seconds_sum") <= ttft


def test_cached_prefix_is_not_prefilled_again(emulator_factory: Callable[..., Emulator]) -> None:
    emu = emulator_factory("--speed", str(SPEED))
    cost = CostModel()
    prompt = list(range(16_000))
    uncached, _ = timed_stream(emu, prompt, 1)
    ttft, _ = timed_stream(emu, prompt, 1)  # 999 blocks cached: one step of 16 tokens
    expected = cost.step_ms(16, 0, 0) / 1000 / SPEED
    b = cost.max_batch_tokens  # 16,000 tokens uncached: two chunks
    full = (cost.step_ms(b, 0, 0) + cost.step_ms(len(prompt) - b, 0, 0)) / 1000 / SPEED
    assert full <= uncached and expected <= ttft <= min(expected + 0.1, full / 3), (ttft, expected, uncached)


def test_arrival_cuts_a_decode_run_at_the_next_step(emulator_factory: Callable[..., Emulator]) -> None:
    # 20 ms steps: a run of 16 decode-only steps is 320 ms; the newcomer must not wait it out.
    emu = emulator_factory("--speed", "1", "--min-step-ms", "20")
    long = threading.Thread(target=timed_stream, args=(emu, [1] * 16, 120))
    long.start()
    try:
        time.sleep(0.5)
        ttft, _ = timed_stream(emu, [2] * 16, 1)
    finally:
        long.join(30)
    assert ttft < 0.15, ttft  # the step in flight and its own (40 ms), slack; not the run's 320 ms


def test_a_prefix_loaded_from_the_host_tier_costs_its_onboarding(emulator_factory: Callable[..., Emulator]) -> None:
    emu = emulator_factory("--speed", str(SPEED), "--num-gpu-blocks", "1100", "--num-cpu-blocks", "4000",
                           "--max-model-len", "16384")
    cost = CostModel()
    a, b = list(range(16_000)), list(range(20_000, 36_000))  # 1,000 blocks each
    timed_stream(emu, a, 1)
    timed_stream(emu, b, 1)  # takes G1's 100 free blocks, then a's from its tail: a keeps 100
    ttft, _ = timed_stream(emu, a, 1)
    loaded = 999 - 100  # the rest of a's cacheable blocks come back from the host tier
    expected = cost.step_ms(16, 0, 0, loaded * 16 * cost.onboard_host_ms_per_token) / 1000 / SPEED
    assert expected <= ttft <= expected + 0.1, (ttft, expected)
    assert emu.metric("vllm:external_prefix_cache_hits_total") == loaded * 16
    assert emu.metric("vllm:prefix_cache_hits_total") == 100 * 16
