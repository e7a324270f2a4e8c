"""A relayed request's life in the fleet's load (DESIGN.md §6): added when it is routed
(under an id minted here, so that no client id can collide), prefill done at its first
token, freed exactly once: at the end of the stream, on an upstream error, on a client
disconnect. The replica shares each op on ``kvstream.active``, so every replica sees the
load; the ``ttft`` policy learns its prefill rates from the first-token times.

The replica's lock is taken on the event loop when it is free or held briefly: while a
snapshot holds it, the op waits in a thread, and the loop keeps relaying
(kvstream.replica.loop_lock).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import anyio

from kvstream.replica import request_ids
from kvstream.replica.replica import Replica
from kvstream.router.active import AddRequest
from kvstream.router.core import PromptTokens
from kvstream.router.errors import RouterError
from kvstream.router.index import WorkerKey
from kvstream.router.router import RouteDecision
from kvstream.router.scheduler import SchedulerOverrides

#: Prompts longer than this (tokens) are routed in a thread: hashing them takes a while.
INLINE_ROUTE_TOKENS = 32_768


class RequestLife:
    """The load one request puts on the fleet, for one attempt at a time."""

    __slots__ = ("added", "limiter", "overrides", "prefilled", "replica", "request_id", "timed", "unshared")

    def __init__(self, replica: Replica, limiter: anyio.CapacityLimiter, timed: bool = True,
                 overrides: SchedulerOverrides | None = None) -> None:
        self.replica, self.limiter = replica, limiter
        #: How its routes are scheduled beyond the replica's configuration (a leg's).
        self.overrides = overrides
        #: False for a leg whose first token follows no prefill (a disaggregated request's
        #: decode leg: its prompt's KV came by transfer): it shares no PREFILL_DONE, so no
        #: replica learns a prefill rate from it, and its worker carries the prompt until
        #: the request ends (the KV it holds is the decode worker's load).
        self.timed = timed
        self.request_id = request_ids.mint("gw-")
        self.added = False
        self.prefilled = False
        #: The add op, until it is on its way to the peers.
        self.unshared: AddRequest | None = None

    async def route(self, ids: PromptTokens, lora: str | None, candidates: Sequence[WorkerKey], track: bool) -> RouteDecision:
        """Choose among ``candidates`` and, when ``track``, add the request's load. The
        peers hear of it as soon as this task yields (once the request is on its way to
        the worker, not before)."""
        inline = len(ids) <= INLINE_ROUTE_TOKENS
        decision = await self.replica.loop_lock.run(
            self._route, ids, lora, candidates, track, inline=inline, limiter=self.limiter
        )
        self.added, self.prefilled = track, False
        if decision.op is not None:
            self.unshared = decision.op
            asyncio.get_running_loop().call_soon(self._share_add)
        return decision

    def _share_add(self) -> None:
        # Also called before any later op of the request: the peers see them in order.
        op, self.unshared = self.unshared, None
        if op is not None:
            self.replica.share(op)

    def _route(self, ids: PromptTokens, lora: str | None, candidates: Sequence[WorkerKey], track: bool) -> RouteDecision:
        return self.replica.route(ids, lora, self.request_id, not track, self.overrides, candidates=candidates,
                                  share=False)

    async def prefill_done(self) -> None:
        self._share_add()
        if self.added and not self.prefilled:
            self.prefilled = True
            if self.timed:
                await self._op(self.replica.prefill_done)

    async def free(self) -> None:
        """The attempt ended: before its first token it is refuted (failed, cancelled or
        moved), and its prompt's blocks are not expected on its worker any more."""
        self._share_add()
        if self.added:
            self.added = False
            await self._op(self.replica.free, not self.prefilled)

    async def _op(self, op: Callable[..., None], *args: object) -> None:
        try:
            await self.replica.loop_lock.run(op, self.request_id, *args, limiter=self.limiter)
        except RouterError:
            pass  # expired meanwhile (a request older than the TTL): nothing left to undo
