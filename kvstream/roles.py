"""The roles of disaggregated serving (issue 34), named once for every layer: a worker's
registration (kvstream.events.registration), the worker's and the gateway's settings, and
the emulated engine's flags."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """What a worker's engine does with a request (issue 34): all of it, or one leg of a
    disaggregated request, as vLLM's ``kv_role`` and SGLang's ``--disaggregation-mode``."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


class Handoff(StrEnum):
    """How a disaggregated request's KV goes from its prefill engine to its decode engine,
    which decides the two legs' bodies (kvstream.gateway.disagg)."""

    #: vLLM's NixlConnector: the prefill leg first (``kv_transfer_params``
    #: ``do_remote_decode``, one token, not streamed); its answer's ``kv_transfer_params``
    #: go with the decode leg.
    NIXL = "nixl"
    #: SGLang's bootstrap: both legs at once, each with the prefill engine's
    #: ``bootstrap_host``/``bootstrap_port`` and one ``bootstrap_room``.
    BOOTSTRAP = "bootstrap"
