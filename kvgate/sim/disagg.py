"""Prefill/decode disaggregation for the simulated engine (SGLang's ``--disaggregation-mode prefill|decode``).

What smg 1.13's PD router does (docs/compatibility.md, measured): it sends the same body to one prefill and one
decode worker at once, with ``bootstrap_host`` (the prefill worker's host), ``bootstrap_port`` (the port given
after its URL in ``--prefill URL PORT``) and a random ``bootstrap_room`` added, and answers the client with the
decode worker's answer. SGLang's two workers then meet through the prefill worker's bootstrap server and the
prefill worker sends the prompt's KV to the decode worker.

The simulator plays this with a small rendezvous: a prefill worker serves ``GET /sim/bootstrap/{room}`` on its
bootstrap port, which answers once that room's prefill finished (the prefill worker ends each request after its
first token, as SGLang's does); a decode worker waits there for each request's room, then for the transfer of the
KV its own radix cache lacks (SGLang's decode matches its radix cache first and asks the prefill worker only for
the rest, ``decode_prefix_len``, disaggregation/decode.py), and then runs the request with that KV in place: no
prefill compute, decode steps as usual. The decode worker is where a session's KV lives between turns (its radix
cache, ``--disaggregation-decode-enable-radix-cache``); the prefill worker's cache holds the prompts it prefilled,
separately.

Departures from SGLang: the decode worker reserves its KV when the transfer ends, not before it (SGLang's decode
pre-allocates in its prealloc queue); the prefill worker frees the prompt's KV as soon as its prefill ends, not
after the transfer; the rendezvous is one HTTP long poll, not SGLang's bootstrap protocol.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import aiohttp
from aiohttp import web

MODES = ("null", "prefill", "decode")

# SGLang 0.5.23 scheduler.py: a disaggregated request without a room is aborted with this (400), unless the
# transfer backend is "fake"
NO_ROOM_MESSAGE = "Invalid request: Disaggregated request received without bootstrap room id."


class TransferFailed(RuntimeError):
    """The prefill of a decode request's room did not finish (it failed, or the wait timed out)."""


def rooms_of(body: dict, count: int) -> list[int]:
    """The bootstrap room of each of ``count`` sequences of a request body (SGLang io_struct.py normalisation:
    one int ``r`` gives ``r, r+1, ...``; a list gives one per prompt, repeated for parallel samples). Raises
    ValueError with SGLang's message when the body has none, or a clear one when it is malformed."""
    room = body.get("bootstrap_room")
    if room is None:
        raise ValueError(NO_ROOM_MESSAGE)
    if isinstance(room, bool):
        raise ValueError("bootstrap_room must be an int or a list of ints")
    if isinstance(room, int):
        return [room + i for i in range(count)]
    if isinstance(room, list) and room and all(isinstance(r, int) and not isinstance(r, bool) for r in room):
        if count % len(room):
            raise ValueError(f"bootstrap_room has {len(room)} rooms for {count} sequences")
        return [room[i % len(room)] for i in range(count)]
    raise ValueError("bootstrap_room must be an int or a list of ints")


def bootstrap_address(body: dict, index: int) -> tuple[str, int]:
    """(host, port) of the prefill worker's bootstrap server for sequence ``index`` (lists are per prompt).
    Raises ValueError when either is missing."""
    host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
    if isinstance(host, list):
        host = host[index % len(host)] if host else None
    if isinstance(port, list):
        port = port[index % len(port)] if port else None
    if not isinstance(host, str) or not host or not isinstance(port, int) or isinstance(port, bool):
        raise ValueError("a decode request needs bootstrap_host and bootstrap_port (the prefill worker's)")
    return host, port


class Rendezvous:
    """The prefill worker's side: rooms whose prefill finished, and the bootstrap HTTP server.

    ``finish(room, info)`` marks a room done (``info`` None: its prefill failed); ``app()`` serves
    ``GET /sim/bootstrap/{room}?timeout=S``: 200 ``{"room", "prompt_tokens"}`` once done, 500 when it failed,
    504 after ``timeout`` seconds. A room nobody fetched is forgotten ``keep_s`` seconds after it finished."""

    def __init__(self, keep_s: float = 600.0):
        self.keep_s = keep_s
        self._rooms: dict[int, asyncio.Future] = {}

    def _future(self, room: int) -> asyncio.Future:
        fut = self._rooms.get(room)
        if fut is None:
            fut = self._rooms[room] = asyncio.get_running_loop().create_future()
        return fut

    def finish(self, room: int, info: Optional[dict]) -> None:
        """Mark ``room``'s prefill done (``info`` its figures) or failed (None)."""
        fut = self._future(room)
        if not fut.done():
            fut.set_result(info)
        asyncio.get_running_loop().call_later(self.keep_s, self._forget, room, fut)

    def _forget(self, room: int, fut: asyncio.Future) -> None:
        if self._rooms.get(room) is fut:
            del self._rooms[room]

    async def wait(self, room: int, timeout_s: float) -> dict:
        """The room's figures once its prefill finished. Raises TransferFailed on a failed prefill or after
        ``timeout_s`` seconds."""
        fut = self._future(room)
        try:
            info = await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except asyncio.TimeoutError:
            raise TransferFailed(f"no prefill of bootstrap room {room} within {timeout_s:g} s") from None
        if info is None:
            raise TransferFailed(f"the prefill of bootstrap room {room} failed")
        self._forget(room, fut)
        return info

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/sim/bootstrap/{room}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.Response:
        try:
            room = int(request.match_info["room"])
            timeout_s = float(request.query.get("timeout", "300"))
        except ValueError:
            return web.json_response({"error": "room must be an int, timeout a number"}, status=400)
        try:
            info = await self.wait(room, timeout_s)
        except TransferFailed as e:
            return web.json_response({"error": str(e)}, status=504 if "within" in str(e) else 500)
        return web.json_response({"room": room, **info})


async def start_bootstrap_server(rendezvous: Rendezvous, host: str, port: int) -> web.AppRunner:
    """Serve ``rendezvous`` on ``host:port`` (the prefill worker's --disaggregation-bootstrap-port)."""
    runner = web.AppRunner(rendezvous.app(), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def fetch_room(http: aiohttp.ClientSession, host: str, port: int, room: int, timeout_s: float) -> dict[str, Any]:
    """The decode worker's side: wait at the prefill worker's bootstrap server until ``room``'s prefill
    finished; returns its figures. Raises TransferFailed when the server is unreachable, the prefill failed
    or ``timeout_s`` passed."""
    url = f"http://{host}:{port}/sim/bootstrap/{room}"
    try:
        async with http.get(url, params={"timeout": f"{timeout_s:g}"},
                            timeout=aiohttp.ClientTimeout(total=timeout_s + 5)) as r:
            body = await r.json(content_type=None)
            if r.status != 200:
                raise TransferFailed(str((body or {}).get("error") or f"bootstrap server answered {r.status}"))
            return body
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise TransferFailed(f"bootstrap server {host}:{port} unreachable: {e!r}") from None


def transfer_seconds(tokens: int, us_per_token: float, speed: float) -> float:
    """Wall seconds the KV transfer of ``tokens`` takes at ``us_per_token`` simulated microseconds per token,
    with simulated time running ``speed`` times faster."""
    return max(tokens, 0) * us_per_token * 1e-6 / max(speed, 1e-9)
