"""The seams of the gateway (kvstream.gateway): what the request path needs from the
worker registry and from tokenization, as Protocols, and the one record they share.

The relay (kvstream.gateway.relay) depends only on these: the registry may be folded
from the ``kvstream.workers`` topic or read from ``[[gateway.workers]]`` in the TOML,
and tokenization may run a local ``tokenizer.json`` or ask the chosen engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvstream.roles import Handoff, Role

if TYPE_CHECKING:
    from kvstream.router.core import PromptTokens


@dataclass(frozen=True, slots=True)
class WorkerEndpoint:
    """One worker as the gateway reaches it: the id its KV events carry, the engine's
    OpenAI-compatible base URL (``http://host:port``, no ``/v1``), and what it serves."""

    worker_id: int
    url: str
    #: Model names the engine answers to (``model`` of a request, ``/v1/models``).
    models: tuple[str, ...]
    #: LoRA adapter names it serves (a request's ``model`` may name one of them).
    loras: tuple[str, ...] = ()
    block_size: int | None = None
    dp_ranks: int = 1
    #: ``vllm``, ``sglang``, ``synthetic``, ``static``, ...
    engine: str = "static"
    #: KV capacity of the engine's device tier in blocks, when the worker knows it.
    kv_capacity_blocks: int | None = None
    #: The worker's own credential (sent as ``Authorization: Bearer``; the client's never is).
    api_key: str | None = field(default=None, repr=False)
    #: Whole requests (BOTH), or one leg of a disaggregated request (issue 34).
    role: Role = Role.BOTH
    #: The KV hand-off of a PREFILL or DECODE worker; None for BOTH.
    handoff: Handoff | None = None
    #: SGLang's prefill engine: its ``--disaggregation-bootstrap-port``.
    bootstrap_port: int | None = None

    def serves(self, model: str) -> bool:
        return model in self.models or model in self.loras


class WorkerDirectory(Protocol):
    """The registered workers, as every replica folds them."""

    def endpoints(self) -> Sequence[WorkerEndpoint]:
        """Every registered worker, in worker id order."""
        ...

    def endpoint(self, worker_id: int) -> WorkerEndpoint | None: ...


class PromptTokenizer(Protocol):
    """Token ids of a request's prompt, exactly as the engine will compute them."""

    def completion_ids(self, prompt: str | Sequence[int]) -> PromptTokens:
        """``prompt`` of ``/v1/completions``: text is tokenized (with the model's special
        tokens, as the engine does; a uint32 array or a list); a list of ints is used as
        given."""
        ...

    def chat_ids(self, body: Mapping[str, Any]) -> PromptTokens:
        """The ids of a ``/v1/chat/completions`` body's ``messages`` rendered by the
        model's chat template (``tools``, ``add_generation_prompt``,
        ``chat_template_kwargs`` honoured as the engine does)."""
        ...
