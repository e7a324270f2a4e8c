"""Disaggregated serving (issue 34): a request whose model is served by PREFILL and DECODE
workers goes to one of each, in two legs whose bodies are the engines' own protocols.

- vLLM's NixlConnector (:attr:`Handoff.NIXL`), as vLLM's own disaggregated proxy drives
  it: the prefill leg first, with ``kv_transfer_params.do_remote_decode``, one token and
  no stream; its answer's ``kv_transfer_params`` (the prefill engine's id, host, port and
  block ids) go with the client's body to the decode worker, whose answer is the client's.
- SGLang's bootstrap (:attr:`Handoff.BOOTSTRAP`), as sglang-router drives it: both legs at
  once, each with the prefill engine's ``bootstrap_host``/``bootstrap_port`` and one
  random ``bootstrap_room`` where the two engines meet.

The bodies are rebuilt from the decoded body (the legs differ from what the client sent);
a whole request (role BOTH) still goes as the client's bytes.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from kvstream.gateway.errors import unavailable
from kvstream.gateway.request_body import dumps
from kvstream.gateway.seams import WorkerEndpoint
from kvstream.roles import Handoff, Role
from kvstream.router.scheduler import SchedulerOverrides

#: What the prefill leg of a NixlConnector request carries: "decode elsewhere", the rest
#: filled in by the prefill engine's answer (vLLM's proxy sends these keys, all null).
_NIXL_PREFILL = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
    "remote_host": None, "remote_port": None,
}
#: How both legs are routed: neither delays the decodes running on its worker (a prefill
#: worker's requests decode elsewhere; a decode worker receives the prompt's KV by
#: transfer, which takes no engine step), so ttft charges them no decode delay
#: (kvstream.router.costs).
LEG_SCHEDULING = SchedulerOverrides(ttft_decode_delay_weight=0.0)
#: Where the two legs of a bootstrap request meet: SGLang's rooms are u63.
_ROOM_BITS = 63


@dataclass(frozen=True, slots=True)
class Plan:
    """The two legs' candidates of one model's disaggregated fleet."""

    handoff: Handoff
    prefill: tuple[WorkerEndpoint, ...]
    decode: tuple[WorkerEndpoint, ...]


def plan(endpoints: Sequence[WorkerEndpoint], model: str, retry_after_s: int) -> Plan | None:
    """None when ``endpoints`` serve whole requests (no PREFILL worker); else the plan,
    over the hand-off of the prefill workers (decode workers of another hand-off cannot
    take their KV). ApiError 503 when no decode worker can."""
    prefill = tuple(ep for ep in endpoints if ep.role is Role.PREFILL)
    if not prefill:
        return None
    handoff = prefill[0].handoff
    assert handoff is not None  # a PREFILL registration names its hand-off
    prefill = tuple(ep for ep in prefill if ep.handoff is handoff)
    decode = tuple(ep for ep in endpoints if ep.role is Role.DECODE and ep.handoff is handoff)
    if not decode:
        raise unavailable(f"{model!r} has prefill workers ({handoff} hand-off) but no decode worker of that hand-off",
                          retry_after_s)
    return Plan(handoff, prefill, decode)


def nixl_prefill_body(body: dict[str, Any]) -> bytes:
    """The prefill leg: compute the prompt, make one token, keep the KV for the decode."""
    leg = {**body, "kv_transfer_params": _NIXL_PREFILL, "stream": False, "max_tokens": 1}
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("stream_options", None)
    return dumps(leg)


def nixl_transfer_params(answer: bytes) -> dict[str, Any]:
    """The prefill answer's ``kv_transfer_params``; ValueError saying why there are none
    (an engine without the connector answers the request as a whole one)."""
    try:
        params = orjson.loads(answer).get("kv_transfer_params")
    except (orjson.JSONDecodeError, AttributeError):
        raise ValueError("its answer is not a JSON object") from None
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        raise ValueError("its answer carries no kv_transfer_params with do_remote_prefill (is its NixlConnector on?)")
    return params


def nixl_decode_body(body: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The decode leg: the client's request, its KV to be read from the prefill engine."""
    return dumps({**body, "kv_transfer_params": params})


def bootstrap_body(body: dict[str, Any], prefill: WorkerEndpoint) -> bytes:
    """Both legs of a bootstrap request (one body: the engines tell their part by role)."""
    assert prefill.bootstrap_port is not None  # a bootstrap PREFILL registration names it
    return dumps({
        **body, "bootstrap_host": urlsplit(prefill.url).hostname, "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": secrets.randbits(_ROOM_BITS),
    })
