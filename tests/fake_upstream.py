"""A scripted upstream on a raw asyncio socket, and a raw HTTP/1.1 client, for bad-input tests.

The upstream answers every request with bytes the test chooses (so it can send what no HTTP library
would: a bad status line, a bad Content-Length, a broken chunk, a 204 with a body) and records each
request exactly as it arrived on the wire. The client sends bytes as given (non-UTF-8 header bytes,
9 KB lines) and reads the answer with a small parser of its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp


@dataclass
class Received:
    """One request as it arrived: the head (request line and headers, raw bytes) and the body bytes."""

    head: bytes
    body: bytes
    size: int = 0  # body bytes received
    sha256: str = ""  # of the body, when the upstream was told not to keep large bodies
    conn: int = 0  # which connection it came on (0 = the first the upstream accepted)
    number: int = 0  # its place on that connection (0 = the first; kvgate's discovery calls not counted)

    @property
    def path(self) -> bytes:
        return self.head.split(b" ", 2)[1]

    def header(self, name: bytes) -> bytes | None:
        """The first header ``name`` (case-insensitive), raw bytes; None when absent."""
        for line in self.head.split(b"\r\n")[1:]:
            k, sep, v = line.partition(b":")
            if sep and k.strip().lower() == name.lower():
                return v.strip(b" \t")
        return None


def response(status: int = 200, body: bytes = b"", headers: list[tuple[bytes, bytes]] | None = None,
             reason: bytes = b"X", chunked: bool = False) -> bytes:
    """A well-formed HTTP/1.1 response with Connection: close (Content-Length or chunked framing)."""
    head = [b"HTTP/1.1 %d %s" % (status, reason)]
    for k, v in headers or []:
        head.append(k + b": " + v)
    head.append(b"Connection: close")
    if chunked:
        head.append(b"Transfer-Encoding: chunked")
        payload = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
        return b"\r\n".join(head) + b"\r\n\r\n" + payload + b"0\r\n\r\n"
    if status not in (204, 304) and not 100 <= status < 200:
        head.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class ScriptedUpstream:
    """``answer(received)`` is written back raw, then the connection is closed.

    With ``keep_alive`` the connection stays open for the next request instead, and ``answer`` may also return
    a tuple (bytes, "close") to answer and then close, None to close without answering, or an async iterator of
    byte pieces (each written and drained in turn: an answer that arrives in parts). GET /workers and
    /list_workers (kvgate's engine discovery) get a 404 and GET /server_info and /get_model_info a 200
    (discovery then takes it for an engine), whatever ``answer`` is, unless ``answers_discovery`` is False
    (``answer`` then answers them too). ``received`` lists every other request (with its connection and its place
    on it); ``arrived`` is set on each; ``connections`` counts the
    connections that carried one.
    """

    def __init__(self, answer: Callable[[Received], Any] | None = None, keep_bodies_up_to: int = 1 << 40,
                 keep_alive: bool = False, answers_discovery: bool = True):
        self.answer = answer or (lambda r: response(200, b'{"ok":true}', [(b"Content-Type", b"application/json")]))
        self.keep_bodies_up_to = keep_bodies_up_to  # larger bodies: only size and sha256 (no big copies)
        self.keep_alive = keep_alive
        self.answers_discovery = answers_discovery
        self.received: list[Received] = []
        self.arrived = asyncio.Event()
        self.url = ""
        self.opened = 0  # connections accepted
        self._used: set[int] = set()  # connections that carried a request (not kvgate's discovery)
        self._server: asyncio.AbstractServer | None = None

    @property
    def connections(self) -> int:
        """Connections that carried a request other than kvgate's discovery calls."""
        return len(self._used)

    async def start(self) -> "ScriptedUpstream":
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, limit=1 << 24)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn, number = self.opened, 0
        self.opened += 1
        try:
            while await self._one(reader, writer, conn, number):
                number += 1
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: int, number: int):
        """Read requests up to one that is not kvgate's discovery call (those are answered here) and answer it
        with ``answer``; returns whether the connection carries another request."""
        while True:
            head = (await reader.readuntil(b"\r\n\r\n"))[:-4]
            rec = Received(head, b"", conn=conn, number=number)
            length = rec.header(b"content-length")
            if length is not None and int(length) > self.keep_bodies_up_to:
                digest, left = hashlib.sha256(), int(length)
                while left:
                    piece = await reader.read(min(left, 1 << 20))
                    if not piece:
                        raise asyncio.IncompleteReadError(b"", left)
                    digest.update(piece)
                    left -= len(piece)
                rec.size, rec.sha256 = int(length), digest.hexdigest()
            elif length is not None:
                rec.body = await reader.readexactly(int(length))
                rec.size = len(rec.body)
            elif (rec.header(b"transfer-encoding") or b"").lower() == b"chunked":
                rec.body = await _read_chunked(reader)
            path = rec.path.split(b"?")[0]
            if self.answers_discovery and path in (b"/workers", b"/list_workers", b"/server_info", b"/get_model_info"):
                ok = path in (b"/server_info", b"/get_model_info")  # what lists no engine: an engine
                answer = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}" if ok
                          else b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                if not self.keep_alive:
                    writer.write(answer.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))
                    await writer.drain()
                    return False
                writer.write(answer)
                await writer.drain()
                continue  # a discovery call takes no number
            self._used.add(conn)
            self.received.append(rec)
            self.arrived.set()
            answer = self.answer(rec)
            if answer is None:
                return False
            close = isinstance(answer, tuple) or not self.keep_alive
            if isinstance(answer, tuple):
                answer = answer[0]
            if hasattr(answer, "__aiter__"):
                async for piece in answer:
                    writer.write(piece)
                    await writer.drain()
            else:
                writer.write(answer)
                await writer.drain()
            return not close


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return bytes(out)
        out += await reader.readexactly(size)
        await reader.readexactly(2)


@dataclass
class Answer:
    """A parsed response: status, headers (raw (name, value) pairs) and the de-framed body."""

    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None


_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def parse_answer(raw: bytes, method: bytes = b"POST") -> Answer | None:
    """Parse one HTTP/1.1 response from ``raw`` (read to EOF); None when it is not a valid response."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.0", b"HTTP/1.1") or not parts[1].isdigit() or len(parts[1]) != 3 \
            or not 200 <= int(parts[1]) <= 599:  # RFC 9112 2.3 and 4; a 1xx alone is no final answer (RFC 9110 15.2)
        return None
    ans = Answer(int(parts[1]))
    for line in lines[1:]:
        k, colon, v = line.partition(b":")
        if not colon or not k or k != k.strip() or _CTL.search(v):  # RFC 9110 5.5: no CTLs but HTAB
            return None
        ans.headers.append((k, v.strip(b" \t")))
    if ans.status in (204, 304) or 100 <= ans.status < 200 or method == b"HEAD":
        return ans if not rest else None  # a body here is a framing error
    te = ans.header(b"transfer-encoding")
    length = ans.header(b"content-length")
    if len([k for k, _ in ans.headers if k.lower() == b"content-length"]) > 1:
        return None  # RFC 9112 6.3: several Content-Length values are an unrecoverable error
    if te is not None and te.lower() == b"chunked":
        body, pos = bytearray(), 0
        while True:
            end = rest.find(b"\r\n", pos)
            if end < 0:
                return None
            try:
                size = int(rest[pos:end].split(b";")[0], 16)
            except ValueError:
                return None
            if size == 0:
                break
            body += rest[end + 2:end + 2 + size]
            if rest[end + 2 + size:end + 4 + size] != b"\r\n":
                return None
            pos = end + 4 + size
        ans.body = bytes(body)
    elif length is not None:
        if not length.isdigit() or int(length) != len(rest):
            return None
        ans.body = rest
    else:
        ans.body = rest
    return ans


async def send_raw(port: int, raw: bytes, timeout: float = 30.0) -> bytes:
    """Send ``raw`` to 127.0.0.1:port and read the answer to EOF (the request should say Connection: close)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        try:
            await writer.drain()
        except ConnectionError:  # the server answered (413 ...) and closed before reading everything
            pass
        try:
            return await asyncio.wait_for(reader.read(), timeout)
        except ConnectionError:
            return b""
    finally:
        writer.close()


def request(method: bytes = b"POST", target: bytes = b"/generate", headers: list[tuple[bytes, bytes]] | None = None,
            body: bytes = b"") -> bytes:
    """A raw HTTP/1.1 request with Content-Length and Connection: close; header bytes sent as given."""
    lines = [method + b" " + target + b" HTTP/1.1", b"Host: upstream"]
    lines += [k + b": " + v for k, v in headers or []]
    lines += [b"Content-Length: %d" % len(body), b"Connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class Canary:
    """GET ``url`` back to back on one connection; ``latencies`` in seconds; ``done`` counts answers."""

    def __init__(self, url: str):
        self.url = url
        self.latencies: list[float] = []
        self.answered = asyncio.Condition()
        self._stop = False

    async def run(self) -> None:
        async with aiohttp.ClientSession() as http:
            while not self._stop:
                t0 = time.perf_counter()
                async with http.get(self.url) as r:
                    await r.read()
                    assert r.status == 200
                self.latencies.append(time.perf_counter() - t0)
                async with self.answered:
                    self.answered.notify_all()

    async def wait_answers(self, n: int) -> None:
        """Wait until at least ``n`` answers more than now have come back."""
        target = len(self.latencies) + n
        async with self.answered:
            await asyncio.wait_for(self.answered.wait_for(lambda: len(self.latencies) >= target), 30)

    async def around(self, work):
        """Run ``await work`` with the canary answering before, during and after it; returns its result."""
        task = asyncio.create_task(self.run())
        try:
            await self.wait_answers(1)
            result = await work
            await self.wait_answers(1)
        finally:
            self._stop = True
            await task
        return result


async def _serve_until_stdin_closes(port: int, keep_bodies_up_to: int) -> None:
    """``python fake_upstream.py PORT KEEP``: a ScriptedUpstream in a process of its own (so the load it
    takes does not share a test's interpreter); prints ``ready``, and when stdin closes one JSON line of
    what it received (path, size, sha256 of each request) and exits."""
    import json
    import sys
    up = ScriptedUpstream(keep_bodies_up_to=keep_bodies_up_to)
    up._server = await asyncio.start_server(up._handle, "127.0.0.1", port, limit=1 << 24)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    up._server.close()
    print(json.dumps([[r.path.decode("latin-1"), r.size, r.sha256 or hashlib.sha256(r.body).hexdigest()]
                      for r in up.received]), flush=True)


if __name__ == "__main__":
    import sys
    asyncio.run(_serve_until_stdin_closes(int(sys.argv[1]), int(sys.argv[2])))
