"""Starting kvgate: bind the port, start the gateway (kvgate.proxy.app.Gateway) on kvgate's own HTTP server or
aiohttp's, and serve until a stop signal (I/O edge).

The port is bound (and let go) before anything starts, so a port in use or not kvgate's to bind is said in one
line before kvgate talks to the router. ``serve`` is what ``kvgate serve`` runs in each process (one of several
on a port too: kvgate.proxy.processes).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import sys
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvgate import __version__
from kvgate.common.admission_seam import Gate
from kvgate.config import PLACEMENT_ROUTES, Config
from kvgate.fleet import compat
from kvgate.proxy.app import Gateway
from kvgate.proxy.relay import MAX_FIELD_BYTES, MAX_LINE_BYTES
from kvgate.proxy.server import HttpServer, Limits

log = logging.getLogger("kvgate")


async def start_parts(gw: Gateway) -> None:
    """Start what the gateway runs beside the request path, in order (each may call the ones before it), after
    saying in the log what this kvgate is and where its session calls go."""
    cfg = gw.cfg
    log.info("kvgate %s: upstream %s, session lifecycle %s, admission %s", __version__, cfg.upstream,
             "on" if gw.lifecycle_on else "off", "on" if cfg.agentic_program_admission else "off")
    log.info(placement_line(gw))
    warning = routing_key_warning(gw)
    if warning is not None:
        log.warning(warning)
    if gw.shared is not None:
        await gw.shared.start()
    if gw.process_role is not None:
        await gw.process_role.start()
    await gw.directory.start()
    await gw.lifecycle.start()
    await gw.gate.start()
    if gw.poller is not None:
        await gw.poller.start()


async def stop_parts(gw: Gateway) -> None:
    """Stop what start_parts started, in the reverse order, and close the upstream connections."""
    if gw.poller is not None:
        await gw.poller.stop()
    await gw.gate.stop()
    await gw.lifecycle.stop()
    if gw.shared is not None:
        await gw.shared.stop()
    if gw.process_role is not None:
        await gw.process_role.stop()
    await gw.directory.stop()
    await gw.upstream.close()


def routing_key_warning(gw: Gateway) -> str | None:
    """The startup warning when kvgate relies on the router's routing key (session traffic it leaves to the
    router) and the router's policy ignores it; None otherwise."""
    cfg = gw.cfg
    relies = (gw.lifecycle_on and cfg.set_routing_key and not all(gw.directory.placed(r) for r in PLACEMENT_ROUTES))
    return compat.routing_key_warning(cfg.router_policy, cfg.routing_key_header,
                                      cfg.router_sticky_sessions) if relies else None


def placement_line(gw: Gateway) -> str:
    """The startup line saying, per generate route, who places session calls and why."""
    return "session placement: " + ", ".join(
        f"{r} {'kvgate' if gw.directory.placed(r) else 'router'} ({gw.directory.placement_why(r)})"
        for r in PLACEMENT_ROUTES)


class _OneLineForBadRequests(logging.Filter):
    """aiohttp logs a traceback at ERROR for every malformed request it answers 400 itself (a bad request
    line, a raw non-ASCII byte in the URL): the client's fault, said in one INFO line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = f"{record.msg}: {type(exc).__name__}, answered {exc.code}"
        return True


async def start_gateway(cfg: Config, gate: Gate | None = None, process_role=None) -> tuple[Gateway, Any, int]:
    """Start kvgate on cfg.host:cfg.port (port 0 = a free one). Returns (gateway, runner, bound port);
    ``await runner.cleanup()`` stops it.

    ``process_role`` (kvgate.proxy.processes.ProcessRole): this process is one of several on the same port: it
    binds with SO_REUSEPORT, also listens on a private 127.0.0.1 port and registers it for its siblings.

    ``http_server: kvgate`` (the default) serves through kvgate.proxy.server, with the same guarantees as
    aiohttp's server below (see that module). ``http_server: aiohttp``: aiohttp's web server;
    handler_cancellation: a client that disconnects cancels its handler, which closes the upstream
    request. auto_decompress=False: request bodies are read and forwarded exactly as received.
    Header limits are the router's or higher (relay.MAX_LINE_BYTES, MAX_FIELD_BYTES).
    """
    if process_role is None and cfg.port:
        check_port(cfg.host, cfg.port)  # before the gateway starts talking to the router and the engines
    gw = Gateway(cfg, gate, process_role)
    if cfg.http_server == "kvgate":
        await start_parts(gw)
        srv = HttpServer(gw.route, cfg.max_body_bytes, on_cleanup=lambda: stop_parts(gw), limits=server_limits(cfg),
                         body_limit=gw.admin.body_limit)
        try:
            port = await srv.listen(cfg.host, cfg.port, backlog=1024,
                                    reuse_port=True if process_role is not None else None)
            if process_role is not None:
                process_role.register(await srv.listen("127.0.0.1", 0))
        except BaseException:
            await srv.cleanup()
            raise
        return gw, srv, port
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _OneLineForBadRequests) for f in server_log.filters):
        server_log.addFilter(_OneLineForBadRequests())
    gw.app.on_startup.append(lambda app: start_parts(gw))
    gw.app.on_cleanup.append(lambda app: stop_parts(gw))
    runner = web.AppRunner(gw.app, handler_cancellation=True, access_log=None, auto_decompress=False,
                           max_line_size=MAX_LINE_BYTES, max_field_size=MAX_FIELD_BYTES)
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port, backlog=1024,
                           reuse_port=True if process_role is not None else None)
        await site.start()
        port = runner.addresses[0][1]  # the first socket of the one site started so far
        if process_role is not None:
            private = web.TCPSite(runner, "127.0.0.1", 0)
            await private.start()
            process_role.register(runner.addresses[-1][1])  # the private site's one socket, started last
    except BaseException:  # the port is taken, say: stop what startup began (pollers, sessions)
        await runner.cleanup()
        raise
    return gw, runner, port


def check_port(host: str, port: int) -> None:
    """Bind ``host:port`` and let it go at once, as the server will bind it (SO_REUSEADDR), so a port in use or
    not ours is said before kvgate starts anything. Raises OSError (EADDRINUSE, EADDRNOTAVAIL, EACCES ...)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    for family, kind, proto, _, addr in infos:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:  # an address family this host lacks (no IPv6): the server skips it too
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio binds each address
            sock.bind(addr)


def server_limits(cfg: Config) -> Limits:
    """The limits kvgate's own HTTP server holds, from the ``http_*`` config keys."""
    return Limits(request_line_bytes=cfg.http_max_request_line_bytes,
                  header_line_bytes=cfg.http_max_header_line_bytes, head_bytes=cfg.http_max_head_bytes,
                  header_count=cfg.http_max_header_count, trailer_bytes=cfg.http_max_trailer_bytes,
                  header_timeout_s=cfg.http_header_timeout_s, body_timeout_s=cfg.http_body_timeout_s,
                  inflight_body_bytes=cfg.http_max_inflight_body_bytes,
                  body_budget_wait_s=cfg.http_body_budget_wait_s)


def serve(cfg: Config, process_role=None) -> int:
    """Run kvgate until SIGINT/SIGTERM (one of several processes also stops when its supervisor is gone).
    Returns the exit status."""
    async def main() -> None:
        gw, runner, port = await start_gateway(cfg, process_role=process_role)
        if process_role is None:
            log.info("kvgate listening on http://%s:%d", cfg.host, port)
        else:
            log.info("process %d of %d serving http://%s:%d (private port %d)", process_role.index,
                     process_role.count, cfg.host, port, process_role.private_port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        watch = None
        if process_role is not None:
            from kvgate.proxy.processes import watch_supervisor
            watch = asyncio.create_task(watch_supervisor(stop))
        await stop.wait()
        log.info("kvgate stopping")
        if watch is not None:
            watch.cancel()
        await runner.cleanup()
        log.info("kvgate stopped")

    run = asyncio.run
    if cfg.event_loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.warning("event_loop: uvloop is not installed; serving on asyncio's event loop")
        else:
            run = uvloop.run
    try:
        run(main())
    except OSError as exc:
        if exc.errno not in _LISTEN_ERRORS:
            raise
        # The port is taken or not ours to bind: one line naming it, as the supervisor of processes says it.
        print(listen_error(cfg.host, cfg.port, exc.errno), file=sys.stderr)
        return 2
    return 0


#: bind() errors that mean the configured host/port cannot be served (the user's to fix, not a kvgate fault),
#: and what to do about each.
_LISTEN_ERRORS = {
    errno.EADDRINUSE: "another process listens there: stop it, or choose another --port",
    errno.EADDRNOTAVAIL: "no interface of this machine has that address: choose another --host",
    errno.EACCES: "a port below 1024 needs root (or CAP_NET_BIND_SERVICE): choose another --port",
}


def listen_error(host: str, port: int, err: int) -> str:
    """The one startup line for a host:port kvgate cannot listen on (bind() failed with errno ``err``): not a
    config error (the config is valid; the machine refuses it), naming host:port, the system's words and what
    to do: ``kvgate: startup error: cannot listen on 127.0.0.1:8080 (Address already in use): another process
    listens there: stop it, or choose another --port``. Pure."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    hint = _LISTEN_ERRORS.get(err)
    return f"kvgate: startup error: cannot listen on {where} ({os.strerror(err)})" + (f": {hint}" if hint else "")

