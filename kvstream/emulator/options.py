"""The emulated engine's options (one frozen record; the flags of ``kvstream emulate``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvstream.emulator.errors import EmulatorConfigError
from kvstream.engine_model.costs import CostModel


@dataclass(frozen=True, slots=True)
class KvEventsOptions:
    """vLLM's ``--kv-events-config`` of a ZMQ publisher: the PUB endpoint, the optional
    replay ROUTER endpoint (both offset by the DP rank, as vLLM does), the topic and how
    many past batches the replay buffer keeps."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise EmulatorConfigError(f"kv events {name} must be a ZMQ address (tcp://host:port), got {value!r}")
        if self.buffer_steps <= 0 or self.hwm <= 0 or self.data_parallel_rank < 0:
            raise EmulatorConfigError("kv events buffer_steps and hwm must be positive, the DP rank >= 0")


@dataclass(frozen=True, slots=True)
class EmulatorOptions:
    """One engine. The defaults are the simulator's (docs/RESULTS.md, "Cost model"):
    Llama-3.1-8B (the Llama-3-8B architecture, 128k context) on one H100, 262,144 tokens
    of G1 in 16-token blocks; the batch limit and token budget are the cost model's."""

    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    max_model_len: int = 131_072
    block_size: int = 16
    num_gpu_blocks: int = 16_384
    #: The host (CPU) tier behind G1, in blocks of ``block_size``; 0: none (vLLM's
    #: default, no KV offloading).
    num_cpu_blocks: int = 0
    cost: CostModel = field(default_factory=CostModel)
    #: Wall-clock seconds are cost-model seconds divided by this.
    speed: float = 1.0
    tokenizer: Path | None = None
    chat_template: Path | None = None
    kv_events: KvEventsOptions | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.num_gpu_blocks <= 0 or self.max_model_len <= 0:
            raise EmulatorConfigError("block_size, num_gpu_blocks and max_model_len must be positive")
        if self.num_cpu_blocks < 0:
            raise EmulatorConfigError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.max_model_len > self.num_gpu_blocks * self.block_size:
            # vLLM refuses to start when one request of the full length cannot fit.
            raise EmulatorConfigError(
                f"max_model_len {self.max_model_len} needs more than the {self.num_gpu_blocks} blocks of "
                f"{self.block_size} tokens of the KV cache (lower --max-model-len or raise --num-gpu-blocks)"
            )
        if not self.speed > 0:
            raise EmulatorConfigError(f"speed must be positive, got {self.speed}")
