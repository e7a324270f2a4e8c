"""The cost model: the time of one engine step (docs/RESULTS.md, "Cost model", has the
sources of every default). ``kvstream simulate`` advances simulated time by it and
``kvstream emulate`` sleeps it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstream.engine_model.errors import EngineModelError


@dataclass(frozen=True, slots=True)
class CostModel:
    """An engine step's time, the same for every policy and for simulate and emulate
    (docs/RESULTS.md has the sources).

    The defaults model an 8B-class model (Llama-3-8B: 16 GB of bf16 weights, 128 KiB
    of KV per token) on one H100-class GPU (3.35 TB/s of HBM, ~400 TFLOP/s achieved)."""

    #: Prefill compute per prompt token not found in any tier (~20k tokens/s).
    prefill_ms_per_token: float = 0.05
    #: Decode compute per running request per step (2 × 8 G FLOP at ~400 TFLOP/s).
    decode_ms_per_token: float = 0.04
    #: Decode KV reads per context token per step (128 KiB at 3.35 TB/s): a step's
    #: decode cost grows with the tokens of the batch.
    decode_ms_per_context_token: float = 0.00004
    #: The shortest step: every step reads the weights once (16 GB at 3.35 TB/s).
    min_step_ms: float = 5.0
    #: Bringing KV back into G1 from host memory, and from disk, per token: bytes
    #: moved, with no compute (128 KiB over ~25 GB/s PCIe, and over ~5 GB/s NVMe).
    onboard_host_ms_per_token: float = 0.005
    onboard_disk_ms_per_token: float = 0.025
    #: Receiving a prompt token's KV from a prefill engine (a disaggregated decode):
    #: bytes moved, no compute (128 KiB over ~50 GB/s of RDMA, a 400 Gb/s NIC).
    kv_transfer_ms_per_token: float = 0.0026
    #: Requests running at once (decoding, or being prefilled).
    batch_limit: int = 32
    #: Tokens per step (chunked prefill; vLLM's --max-num-batched-tokens).
    max_batch_tokens: int = 8192

    def __post_init__(self) -> None:
        for name in ("prefill_ms_per_token", "decode_ms_per_token", "decode_ms_per_context_token",
                     "min_step_ms", "onboard_host_ms_per_token", "onboard_disk_ms_per_token",
                     "kv_transfer_ms_per_token"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise EngineModelError(f"cost {name} must be a finite number >= 0, got {value}")
        if self.batch_limit <= 0:
            raise EngineModelError(f"batch_limit must be positive, got {self.batch_limit}")
        if self.max_batch_tokens <= self.batch_limit:
            raise EngineModelError(
                f"max_batch_tokens ({self.max_batch_tokens}) must exceed batch_limit ({self.batch_limit}): "
                "a full batch of decodes would leave no token for a prefill"
            )

    def step_ms(self, prefill_tokens: int, running: int, context: int, onboard_ms: float = 0.0) -> float:
        """One step that prefills ``prefill_tokens``, onboards for ``onboard_ms`` and
        decodes one token for each of ``running`` requests holding ``context`` tokens."""
        prefill_ms = prefill_tokens * self.prefill_ms_per_token + onboard_ms
        decode_ms = running * self.decode_ms_per_token + context * self.decode_ms_per_context_token
        return max(self.min_step_ms, prefill_ms + decode_ms)

    def decode_steps_ms(self, steps: int, running: int, context: int) -> float:
        """Time of ``steps`` decode-only steps of ``running`` requests holding ``context``
        tokens at the first step (each step adds one token per request)."""
        a = running * self.decode_ms_per_token + context * self.decode_ms_per_context_token
        d = running * self.decode_ms_per_context_token
        # Steps j = 0..steps-1 cost max(min, a + d·j); the first `low` are clamped.
        low = steps if d == 0 and a < self.min_step_ms else 0
        if a < self.min_step_ms and d > 0:
            low = min(steps, math.ceil((self.min_step_ms - a) / d))
        rest = steps - low
        return low * self.min_step_ms + rest * a + d * (low * rest + rest * (rest - 1) / 2)
