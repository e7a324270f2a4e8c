"""The emulated engine's options (one frozen record; the flags of ``kvstream emulate``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvstream.emulator.errors import EmulatorConfigError
from kvstream.engine_model.costs import CostModel
from kvstream.roles import Handoff, Role



@dataclass(frozen=True, slots=True)
class KvEventsOptions:
    """vLLM's ``--kv-events-config`` of a ZMQ publisher: the PUB endpoint, the optional
    replay ROUTER endpoint (each engine offsets both by its DP rank, as vLLM does), the
    topic and how many past batches the replay buffer keeps."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise EmulatorConfigError(f"kv events {name} must be a ZMQ address (tcp://host:port), got {value!r}")
        if self.buffer_steps <= 0 or self.hwm <= 0:
            raise EmulatorConfigError("kv events buffer_steps and hwm must be positive")


@dataclass(frozen=True, slots=True)
class EmulatorOptions:
    """One engine (of ``data_parallel_size`` ranks). The defaults are the simulator's
    (docs/RESULTS.md, "Cost model"): Llama-3.1-8B (the Llama-3-8B architecture, 128k
    context) on one H100, 262,144 tokens of G1 in 16-token blocks; the batch limit and
    token budget are the cost model's."""

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
    #: ``--data-parallel-size``: ranks behind the one HTTP server, each its own scheduler,
    #: KV cache and KV-event publisher (vLLM's internal load balancing).
    data_parallel_size: int = 1
    #: ``--data-parallel-rank``: the rank of a one-rank engine (vLLM's external load
    #: balancing: one server per rank); stamped on its KV events and metrics, added to its
    #: KV-event ports.
    data_parallel_rank: int = 0
    #: ``--role`` (a Role's value): a whole engine, or one side of a disaggregated pair.
    role: str = "both"
    #: ``--handoff`` (a Handoff's value): how a prefill engine hands a prompt's KV to a
    #: decode engine; required for a prefill or decode role, refused for both.
    handoff: str | None = None
    #: The bootstrap server's port of a prefill engine with the bootstrap hand-off.
    bootstrap_port: int | None = None

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
        if self.data_parallel_size < 1 or self.data_parallel_rank < 0:
            raise EmulatorConfigError("data_parallel_size must be >= 1 and data_parallel_rank >= 0")
        if self.data_parallel_size > 1 and self.data_parallel_rank:
            # Several ranks starting at R would be vLLM's hybrid load balancing, where the
            # X-data-parallel-rank header indexes the local ranks, not names a rank: refused
            # rather than half emulated.
            raise EmulatorConfigError(
                "--data-parallel-rank is for a one-rank engine; with --data-parallel-size the ranks are 0 to size-1")
        if self.role not in tuple(Role):
            raise EmulatorConfigError(f"role must be one of {', '.join(Role)}, got {self.role!r}")
        if self.handoff is not None and self.handoff not in tuple(Handoff):
            raise EmulatorConfigError(f"handoff must be one of {', '.join(Handoff)}, got {self.handoff!r}")
        if self.role == "both" and self.handoff is not None:
            raise EmulatorConfigError("a handoff protocol (--handoff) is for role prefill or decode, not role both")
        if self.role != "both" and self.handoff is None:
            raise EmulatorConfigError(f"role {self.role} needs a handoff protocol (--handoff nixl or bootstrap)")
        bootstrap_server = self.role == "prefill" and self.handoff == "bootstrap"
        if bootstrap_server and self.bootstrap_port is None:
            raise EmulatorConfigError(
                "role prefill with the bootstrap handoff needs its bootstrap server's port (--bootstrap-port)")
        if not bootstrap_server and self.bootstrap_port is not None:
            raise EmulatorConfigError(
                "a bootstrap port (--bootstrap-port) is only for role prefill with the bootstrap handoff")
        if self.bootstrap_port is not None and not 1 <= self.bootstrap_port <= 65535:
            raise EmulatorConfigError(f"bootstrap port must be 1 to 65535, got {self.bootstrap_port}")

    @property
    def ranks(self) -> range:
        """The DP ranks this server runs, in order (the header's index is the position)."""
        return range(self.data_parallel_rank, self.data_parallel_rank + self.data_parallel_size)
