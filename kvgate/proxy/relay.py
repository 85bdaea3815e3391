"""Relaying one request to the upstream router and its response back, chunk by chunk (I/O edge).

Hop-by-hop headers are dropped both ways (RFC 9110 section 7.6.1); everything else passes as is.
The upstream client never decompresses, so bodies and Content-Encoding pass through untouched.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from kvgate.sessions.observe import ResponseObserver

log = logging.getLogger("kvgate.proxy.relay")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
    "trailer", "trailers", "transfer-encoding", "upgrade",
})
# Recomputed by the HTTP layer on the way out.
_RECOMPUTED_REQUEST = frozenset({"host", "content-length"})


def _without_hop_by_hop(headers: Mapping[str, str], drop: frozenset = frozenset()) -> CIMultiDict:
    """``headers`` less hop-by-hop ones, those the Connection header names, and ``drop`` (lower-case)."""
    named = {h.strip().lower() for h in headers.get("Connection", "").split(",") if h.strip()}
    out = CIMultiDict()
    for k, v in headers.items():
        lk = k.lower()
        if lk in HOP_BY_HOP or lk in named or lk in drop:
            continue
        out.add(k, v)
    return out


def forward_headers(headers: Mapping[str, str], extra: Mapping[str, str] | None = None) -> CIMultiDict:
    """Request headers for the upstream: hop-by-hop, Host and Content-Length removed, ``extra`` set."""
    out = _without_hop_by_hop(headers, _RECOMPUTED_REQUEST)
    for k, v in (extra or {}).items():
        out[k] = v
    return out


def response_headers(headers: Mapping[str, str]) -> CIMultiDict:
    """Upstream response headers to relay: hop-by-hop removed (Content-Length kept)."""
    return _without_hop_by_hop(headers)


def error_response(status: int, message: str, kind: str, upstream: str) -> web.Response:
    """A kvgate-made JSON error in SGLang's error shape, naming the upstream."""
    body = {"error": {"message": message, "type": kind, "code": status, "upstream": upstream}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json",
                        headers={"X-Kvgate-Error": kind})


@dataclass
class RelayOutcome:
    """What happened: upstream status (None if it never answered), what the observer saw, and why it ended."""

    status: int | None
    observer: ResponseObserver | None
    ended: str  # "complete" | "upstream_error" | "client_gone" | "unreachable" | "timeout"
    # False only when the connection was never made, so no byte of the request went out (safe to resend).
    sent: bool = True


class Upstream:
    """One pooled client session to the router. ``close()`` it on shutdown.

    base: router base URL; connect_timeout_s / read_timeout_s (0 = no read timeout) in seconds.
    """

    def __init__(self, base: str, connect_timeout_s: float, read_timeout_s: float, pool_size: int = 0):
        self.base = base.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s,
                                             sock_read=read_timeout_s or None)
        self._pool_size = pool_size
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._pool_size, ttl_dns_cache=300),
                timeout=self.timeout, auto_decompress=False,
                # Transparent: add no headers the client did not send.
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def relay(self, request: web.Request, path_qs: str, headers: CIMultiDict, body: bytes,
                    observe: Callable[[bool], ResponseObserver] | None, add_headers: Iterable[tuple[str, str]] = (),
                    on_headers: Callable[[int], None] | None = None,
                    base: str | None = None) -> tuple[web.StreamResponse, RelayOutcome]:
        """Send ``body`` to base+``path_qs`` and stream the answer to ``request``'s client.

        base: another base URL than the router's (an engine kvgate placed a session on); same pool.

        observe: None, or a factory (is_sse -> ResponseObserver) for responses kvgate reads as they pass.
        Returns the response object (already prepared and finished, or an error Response to return)
        and the outcome. When the client goes away the handler is cancelled (handler_cancellation)
        or a write fails: either way leaving the ``async with`` closes the upstream connection, which
        cancels the upstream request.
        """
        # The raw path and query, not re-encoded: what the client sent is what the router gets.
        base = base or self.base
        url = URL(base + path_qs, encoded=True)
        try:
            async with self.session.request(request.method, url, headers=headers, data=body,
                                            allow_redirects=False) as up:
                if on_headers is not None:
                    on_headers(up.status)
                out_headers = response_headers(up.headers)
                for k, v in add_headers:
                    out_headers[k] = v
                resp = web.StreamResponse(status=up.status, reason=up.reason, headers=out_headers)
                ctype = up.headers.get("Content-Type", "")
                observer = None
                if observe is not None and "Content-Encoding" not in up.headers:
                    observer = observe(ctype.startswith("text/event-stream"))
                await resp.prepare(request)
                chunks = up.content.iter_any()
                while True:
                    try:
                        chunk = await chunks.__anext__()
                    except StopAsyncIteration:
                        break
                    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                        # Upstream cut the body mid-way: the client sees the cut too (no fake completion).
                        log.warning("upstream %s cut the response to %s mid-way: %s", base, path_qs, exc)
                        _abort_client(request)
                        return resp, RelayOutcome(up.status, observer, "upstream_error")
                    if observer is not None:
                        observer.feed(chunk)
                    try:
                        await resp.write(chunk)
                    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                        return resp, RelayOutcome(up.status, observer, "client_gone")
                await resp.write_eof()
                return resp, RelayOutcome(up.status, observer, "complete")
        except asyncio.TimeoutError:
            err = error_response(504, f"kvgate: upstream {base} timed out", "upstream_timeout", base)
            outcome = RelayOutcome(None, None, "timeout")
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            err = error_response(502, f"kvgate: upstream {base} unreachable: {exc}", "upstream_unreachable", base)
            outcome = RelayOutcome(None, None, "unreachable", sent=not isinstance(exc, aiohttp.ClientConnectorError))
        for k, v in add_headers:  # the admission decision is reported on kvgate's own errors too
            err.headers[k] = v
        return err, outcome


def _abort_client(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.close()
