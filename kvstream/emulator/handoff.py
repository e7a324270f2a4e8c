"""One leg of a disaggregated (prefill/decode) request, ``--role prefill|decode``, by either
hand-off (``--handoff``):

- ``nixl``: vLLM's NixlConnector, as vLLM's toy disaggregated proxy drives it. The prefill
  leg carries ``kv_transfer_params.do_remote_decode``; the prefill engine answers with the
  ``kv_transfer_params`` its connector's ``request_finished`` makes (where the prompt's
  blocks are), which the router passes on to the decode leg (``do_remote_prefill``).
- ``bootstrap``: SGLang's PD disaggregation, as sglang-router drives it. Both legs come at
  once with ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``; the prefill
  engine's bootstrap server (``GET /kv/{room}``) tells the decode engine when the room's
  prefill is done, and the decode leg waits for it.

Either way the decode engine receives the prompt's KV it lacks at the cost model's
transfer cost per token (kvstream.emulator.scheduler): no KV moves, only time passes.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvstream.emulator.errors import RequestError
from kvstream.emulator.options import EmulatorOptions
from kvstream.emulator.scheduler import EngineRequest

#: How long the bootstrap server waits for a room it does not know (a decode leg may
#: arrive before its prefill leg) before answering 404.
ROOM_WAIT_S = 30.0
#: A decode leg's bound on its bootstrap request: the room's appearance and its whole
#: prefill (SGLang's decode gives up on a transfer after 300 s by default).
FETCH_TIMEOUT_S = 300.0
#: How long a finished room's outcome stays known, for a decode leg that comes late.
_KEEP_S = 60.0
_PARAMS = "kv_transfer_params"
#: SGLang's names (``PDRoutingFields``, sglang/srt/entrypoints/openai/protocol.py).
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass(frozen=True, slots=True)
class Leg:
    """What a request is to this engine: the prefill leg (its prompt's KV goes to a
    decode engine), the decode leg (the KV comes from a prefill engine), or neither."""

    send: bool = False
    receive: bool = False
    #: The bootstrap hand-off's room, and (decode leg) the prefill's bootstrap server.
    room: int | None = None
    bootstrap: tuple[str, int] | None = None


def leg(body: Any, options: EmulatorOptions) -> Leg:
    """The request's leg, its hand-off fields checked (400 when malformed)."""
    if not isinstance(body, Mapping):
        return Leg()  # refused by protocol.parse
    if options.handoff == "bootstrap":
        return _bootstrap_leg(body, options.role)
    return _nixl_leg(body, options.role)


def _field(obj: Mapping[str, Any], name: str, kind: type, param: str, *, required: bool = False) -> Any:
    value = obj.get(name)
    if value is None and not required:
        return None
    # bool is an int in Python; vLLM's and SGLang's pydantic models refuse it for an int.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        what = "is required" if value is None else f"must be of type {kind.__name__}, got {value!r}"
        raise RequestError(f"{param} {what}", param=param.split(".")[0])
    return value


def _nixl_leg(body: Mapping[str, Any], role: str) -> Leg:
    params = body.get(_PARAMS)
    if params is None:
        return Leg()
    if not isinstance(params, Mapping):
        raise RequestError(f"{_PARAMS} must be an object, got {params!r}", param=_PARAMS)
    if role == "both":
        return Leg()  # no KV connector: vLLM checks only that the field is an object
    send = _field(params, "do_remote_decode", bool, f"{_PARAMS}.do_remote_decode")
    receive = _field(params, "do_remote_prefill", bool, f"{_PARAMS}.do_remote_prefill")
    # A leg meant for the other side (or no leg) is served as a whole request, as vLLM
    # serves a request its connector has nothing to do for.
    if role == "prefill" and send:
        return Leg(send=True)
    if role == "decode" and receive:
        for name, kind in (("remote_engine_id", str), ("remote_request_id", str), ("remote_host", str),
                           ("remote_port", int), ("remote_block_ids", list)):
            _field(params, name, kind, f"{_PARAMS}.{name}", required=True)
        if not all(isinstance(g, list) and all(isinstance(b, int) and not isinstance(b, bool) for b in g)
                   for g in params["remote_block_ids"]):
            raise RequestError(f"{_PARAMS}.remote_block_ids must be a list of lists of block ids", param=_PARAMS)
        return Leg(receive=True)
    return Leg()


def _bootstrap_leg(body: Mapping[str, Any], role: str) -> Leg:
    # SGLang's PDRoutingFields also take lists (a batch); the emulator serves one prompt.
    host, port, room = (_field(body, name, kind, name, required=True)
                        for name, kind in zip(BOOTSTRAP_FIELDS, (str, int, int), strict=True))
    if not 0 <= room < 2**63:
        raise RequestError(f"bootstrap_room must be in [0, 2**63), got {room}", param="bootstrap_room")
    if role == "prefill":
        return Leg(send=True, room=room)
    return Leg(receive=True, room=room, bootstrap=(host, port))


def nixl_params(req: EngineRequest, engine_id: str, block_size: int, host: str, port: int) -> dict[str, Any]:
    """What vLLM 0.33's NixlConnector ``request_finished`` returns for a finished prefill
    leg (nixl/pull_scheduler.py): where the decode engine reads the prompt's KV. The
    side channel is the HTTP port here (nothing listens on a second one)."""
    return dict(
        do_remote_prefill=True,
        do_remote_decode=False,
        remote_block_ids=[req.blocks[:math.ceil(len(req.prompt) / block_size)]],
        remote_engine_id=engine_id,
        remote_request_id=req.request_id,
        remote_host=host,
        remote_port=port,
        tp_size=1,
        dcp_size=1,
        pp_size=1,
        remote_num_tokens=len(req.prompt),
        remote_blocks_expiry_time=None,
        remote_registration_generation=0,
        transfer_mode="pull",
    )


async def receive(session: aiohttp.ClientSession, leg: Leg, prompt_tokens: int) -> None:
    """Wait for the decode leg's room on the prefill's bootstrap server; a 500 with the
    reason when the prefill failed, is unknown or unreachable, never a hang."""
    assert leg.bootstrap is not None
    host, port = leg.bootstrap
    try:
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/kv/{leg.room}"
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)) as resp:
            answer = await resp.json(content_type=None)
        if resp.status != 200:
            reason = f"HTTP {resp.status}: {answer.get('error') if isinstance(answer, dict) else answer}"
        elif answer.get("prompt_tokens") != prompt_tokens:
            reason = (f"the prefill computed {answer.get('prompt_tokens')} prompt tokens, this request has "
                      f"{prompt_tokens}")
        else:
            return
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    raise RequestError(f"KV transfer from bootstrap host {host}:{port} room {leg.room} failed: {reason}",
                       status=500, err_type="InternalServerError")


@dataclass(eq=False, slots=True)
class _Room:
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    #: (HTTP status, body) of ``GET /kv/{room}`` once the prefill ended.
    outcome: asyncio.Future[tuple[int, dict[str, Any]]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class Rooms:
    """The emulation of SGLang's bootstrap server on a prefill engine: the rooms of the
    prefill legs it serves, and ``GET /kv/{room}``, which answers once that room's
    prefill ended: 200 when its KV is ready, 410 when it failed or was aborted, 404 when
    the room did not appear within :data:`ROOM_WAIT_S`. One per server, as SGLang's: its
    DP ranks share the rooms (a room is one request, on whichever rank served it)."""

    def __init__(self) -> None:
        self._rooms: dict[int, _Room] = {}

    def _room(self, room: int) -> _Room:
        return self._rooms.setdefault(room, _Room())

    def open(self, room: int) -> None:
        r = self._room(room)
        if r.opened.is_set():
            raise RequestError(f"bootstrap_room {room} is already in use on this prefill engine",
                               param="bootstrap_room")
        r.opened.set()

    def close(self, room: int, req: EngineRequest | None, engine_id: str | None) -> None:
        """The room's prefill leg ended on the engine ``engine_id``: its KV is ready when
        it made its first token."""
        r = self._rooms[room]
        if req is not None and req.first_token is not None:
            ready = {"room": room, "prompt_tokens": len(req.prompt), "engine_id": engine_id}
            r.outcome.set_result((200, ready))
        else:
            r.outcome.set_result((410, {"room": room, "error": f"the prefill of room {room} failed or was aborted"}))
        asyncio.get_running_loop().call_later(_KEEP_S, self._forget, room, r)

    def _forget(self, room: int, r: _Room) -> None:
        if self._rooms.get(room) is r:
            del self._rooms[room]

    async def kv(self, request: web.Request) -> web.Response:
        room = int(request.match_info["room"])
        r = self._room(room)
        try:
            await asyncio.wait_for(r.opened.wait(), ROOM_WAIT_S)
        except TimeoutError:
            self._forget(room, r)
            return web.json_response({"room": room, "error": f"room {room} is not known to this prefill engine"},
                                     status=404)
        # Shielded: a decode leg that goes away must not cancel the room's outcome.
        status, body = await asyncio.shield(r.outcome)
        return web.json_response(body, status=status)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(r"/kv/{room:\d+}", self.kv)
        return app
