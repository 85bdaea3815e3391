"""The HTTP/1.1 wire rules of kvgate's server, with no I/O (pure; no asyncio): what a client may send
(``Limits``), how a refusal is said (``BadRequest``, ``error_answer``), a request's headers (``Headers``),
how a request line must look (``request_line_at``) and how a response is framed (``response_head``,
``header_lines``, ``chunk_frame``).

kvgate.proxy.server is the asyncio shell that applies them on a connection; tests/test_wire.py tests them
without sockets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Iterable

# Header limits no lower than the router's. Measured on smg 1.13 (hyper): a 400 KB header and a 9 KB URL
# pass, a 1 MB header is 431 and a 64 KiB URL is 414. aiohttp's defaults (8190 bytes) were lower.
MAX_LINE_BYTES = 128 * 1024   # request or status line, so the router answers an over-long URL itself
MAX_FIELD_BYTES = 512 * 1024  # one header line
# The request line and headers together; a larger head is answered 431 (the parser would hold it all).
MAX_HEAD_BYTES = 2 << 20
# The body limit of the routes kvgate answers itself from a few bytes (/close_session, /kvgate/...): a larger
# body is refused 413 from its declared length, or once this many bytes of it arrived.
SMALL_BODY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client may send kvgate's server (bytes, seconds, a count); each is a config key of the same
    name with ``http_`` in front (docs/configuration.md). docs/guarantees.md puts each beside smg 1.13's and
    nginx's, as measured by scripts/probe_limits.py. A request over a limit is answered and its connection
    closed, with one INFO log line: 400 (request line, trailer section), 431 (header count, a header line, the
    whole head), 413 (a body declared or sent over ``max_body_bytes``), 408 (a head or a body that stopped
    arriving), 503 (the in-flight body budget stayed full for ``body_budget_wait_s``)."""

    request_line_bytes: int = MAX_LINE_BYTES
    header_line_bytes: int = MAX_FIELD_BYTES
    head_bytes: int = MAX_HEAD_BYTES
    header_count: int = 1000
    trailer_bytes: int = 1 << 20
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    # Request body bytes held in memory at once, all connections together (a larger body than this goes
    # alone); past it, a body waits (its connection's reading paused) for at most body_budget_wait_s.
    inflight_body_bytes: int = 1 << 30
    body_budget_wait_s: float = 60.0


class BadRequest(Exception):
    """A request kvgate answers itself and then closes the connection: ``status``, a short reason and, for a
    refusal the client may retry (503), ``retry_after_s``: the whole seconds of the answer's Retry-After."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str] | None:
        """The answer's extra headers: Retry-After when set, else None."""
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None


def budget_retry_after_s(body_budget_wait_s: float) -> int:
    """Retry-After of the body-budget 503, whole seconds (at least 1): the wait the body just had without room,
    rounded up (an earlier retry would likely wait as long again)."""
    return max(1, math.ceil(body_budget_wait_s))


def error_body(status: int, message: object) -> str:
    """The plain-text body of a kvgate-made refusal: ``413 Request Entity Too Large: <message>``."""
    return f"{status} {HTTPStatus(status).phrase}: {message}\n"


def error_answer(err: BadRequest) -> bytes:
    """The whole answer to a request refused with ``err``, closing the connection."""
    body = error_body(err.status, err).encode("utf-8", "replace")
    retry = b"Retry-After: %d\r\n" % err.retry_after_s if err.retry_after_s is not None else b""
    return b"".join((status_line(err.status), retry, b"Content-Type: text/plain; charset=utf-8\r\n",
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body), body))


# How smg 1.13 answers a request line it does not serve (scripts/probe_limits.py): 400 for a request line
# without a version (HTTP/0.9) and for HTTP/2.0 on an HTTP/1 connection; 404 for CONNECT (no route).
BAD_VERSION = {"0": (400, "a request line without an HTTP/1.x version"),
               "2": (400, "HTTP/2 on an HTTP/1 connection")}
CONNECT_ANSWER = (404, "CONNECT: kvgate tunnels nothing")
VERSIONS = {"1.1": (1, 1), "1.0": (1, 0)}


def request_line_at(seen: bytes, start: int, method: bytes, url: bytes, version: str) -> tuple[bool, int]:
    """Whether this request's line is in the strict form RFC 9112 section 3 gives, ``method SP
    request-target SP HTTP/x.y CRLF`` with one space each, as smg (hyper) requires; llhttp (httptools) also
    accepts runs of spaces after the method and after the target, which smg answers 400, as kvgate does.

    seen: the bytes of the read(s) in which the request's head arrived; start: where in them the requests
    before it in the same read ended (their request lines). Returns (ok, where this line ends): not ok when
    a spaced-out form of the line comes before its strict form; ok when the strict form comes first, or
    when neither is found (what cannot be seen is not refused)."""
    end = start + len(method) + len(url) + 12
    if seen[start:end] == b"".join((method, b" ", url, _HTTP_TAIL.get(version, b"-"))):
        return True, end  # the common case: the line where the request starts, strict (one compare)
    strict = b"%s %s HTTP/%s\r\n" % (method, url, version.encode("ascii"))
    at = seen.find(strict, start)
    stop = at if at >= 0 else len(seen)
    needle = b" " + url + b" "
    m = seen.find(needle, start, stop + len(needle))
    while 0 <= m < stop:
        end = _spaced_line_end(seen, m, method, url, version)
        if end:
            return False, end
        m = seen.find(needle, m + 1, stop + len(needle))
    return True, (at + len(strict) if at >= 0 else start)


_HTTP_TAIL = {"1.1": b" HTTP/1.1\r\n", "1.0": b" HTTP/1.0\r\n"}


def _spaced_line_end(seen: bytes, m: int, method: bytes, url: bytes, version: str) -> int:
    """The end of ``method SP+ url SP+ HTTP/version CRLF`` when ``seen[m:]`` is its `` url `` part, else 0."""
    i = m
    while i > 0 and seen[i - 1] == 0x20:
        i -= 1
    if seen[i - len(method):i] != method or i < len(method):
        return 0
    j = m + 1 + len(url)
    while j < len(seen) and seen[j] == 0x20:
        j += 1
    tail = b"HTTP/%s\r\n" % version.encode("ascii")
    return j + len(tail) if seen.startswith(tail, j) else 0


def origin_form(url: bytes) -> bytes:
    """An absolute-form target (``http://host/path?q``, RFC 9112 3.2.2, what a client using kvgate as its
    HTTP proxy sends) as the origin-form kvgate routes and forwards (``/path?q``); others unchanged."""
    low = url[:8].lower()
    if not (low.startswith(b"http://") or low.startswith(b"https://")):
        return url
    rest = url[url.index(b"//") + 2:]
    for i, c in enumerate(rest):
        if c == 0x2F:  # /
            return rest[i:]
        if c == 0x3F:  # ?
            return b"/" + rest[i:]
    return b"/"


# --- responses ------------------------------------------------------------------------------------------

NO_BODY_STATUS = frozenset({204, 304})
# Framing and connection headers: the server sets them itself.
SERIALISED = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int, reason: bytes = b"") -> bytes:
    """``HTTP/1.1 <status> <reason>\\r\\n``; an empty reason is the standard phrase (cached)."""
    if reason:
        return b"HTTP/1.1 %d %s\r\n" % (status, reason)
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase.encode("ascii")
        except ValueError:
            phrase = b""
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase)
    return line


def safe_header(text: str) -> str:
    """``text`` unchanged; raises ValueError when it holds a CR, LF or NUL (header injection, RFC 9110
    section 5.5: such a value would end the line and start another)."""
    if "\r" in text or "\n" in text or "\x00" in text:
        raise ValueError(f"Newline or carriage return character detected in HTTP status message or header. "
                         f"This is a potential security issue: {text!r}")
    return text


def header_lines(headers: Iterable[tuple[str, str]], first: str | None = None) -> bytes:
    """``Name: value\\r\\n`` lines for str headers, after a ``first`` line (a status line) when given; bytes
    that came in as surrogate escapes go out as they came. Raises ValueError for a CR, LF or NUL in a line
    (safe_header; checked only when the text has more of them than line ends, or a NUL)."""
    items = list(headers)
    lines = [f"{k}: {v}\r\n" for k, v in items]
    if first is not None:
        lines.insert(0, first + "\r\n")
    text = "".join(lines)
    if text.count("\r") != len(lines) or text.count("\n") != len(lines) or "\x00" in text:
        if first is not None:
            safe_header(first)
        for k, v in items:
            safe_header(k)
            safe_header(v)
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that did not come from the wire: dropped, as aiohttp does
        return text.encode("utf-8", "ignore")


def chunk_frame(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (RFC 9112 section 7.1)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def response_head(status: int, reason: bytes, lines: bytes, length: int | None, stream: bool,
                  version: tuple[int, int], keep_alive: bool, head_only: bool) -> tuple[bytes, bool, bool]:
    """A response head and its framing. ``lines``: header lines as bytes; length: the Content-Length to add
    (None: the lines carry the framing or there is no body); stream: the body follows in pieces of unknown
    total length; keep_alive: the connection may carry another request; head_only: a HEAD request's answer.
    Returns (head bytes, whether the body is chunked, whether the connection stays open): HTTP/1.1 streams
    chunked, HTTP/1.0 ends such a body by closing (RFC 9112 sections 6.3 and 9.3)."""
    extra = b""
    chunked = False
    if length is not None:
        extra = b"Content-Length: %d\r\n" % length
    elif stream and not head_only:
        if version >= (1, 1):
            chunked = True
            extra = b"Transfer-Encoding: chunked\r\n"
        else:
            keep_alive = False
    if not keep_alive:
        extra += b"Connection: close\r\n"
    elif version < (1, 1):
        extra += b"Connection: keep-alive\r\n"
    return b"".join((status_line(status, reason), lines, extra, b"\r\n")), chunked, keep_alive


def has_body(status: int) -> bool:
    """Whether an answer with ``status`` carries a body (RFC 9110 section 6.4.1: not 1xx, 204, 304)."""
    return status >= 200 and status not in NO_BODY_STATUS


# --- request headers ------------------------------------------------------------------------------------

class Headers(Mapping):
    """A request's headers as str, read-only and case-insensitive, looked up in its raw (name, value) byte
    pairs (a request has few headers: a scan allocates nothing kept, where a multidict per request would
    stay with every waiting request). Values are decoded as UTF-8 with surrogate escapes, as aiohttp does;
    ``get`` and ``[]`` give the first of several. The lowered names are made once, on the first lookup (a
    call is looked up about ten times on its way: session, admission, relay)."""

    __slots__ = ("_raw", "_low")
    case_insensitive = True

    def __init__(self, flat: tuple):
        self._raw = flat  # name, value, name, value ...
        self._low: tuple | None = None  # the names lowered, in order (made on first lookup)

    def get(self, name: str, default=None):
        low = self._low
        if low is None:
            low = self._low = tuple([COMMON.get(k, k) for k in map(bytes.lower, self._raw[::2])])
        lname = _LOWER_NAMES.get(name)
        if lname is None:
            lname = _lower_name(name)
        if lname not in low:
            return default
        return self._raw[2 * low.index(lname) + 1].decode("utf-8", "surrogateescape")

    def __getitem__(self, name: str) -> str:
        v = self.get(name)
        if v is None:
            raise KeyError(name)
        return v

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def getall(self, name: str, default=None) -> list[str]:
        lname = name.lower().encode("latin-1")
        out = [v.decode("utf-8", "surrogateescape") for k, v in pairs(self._raw) if k.lower() == lname]
        if not out and default is None:
            raise KeyError(name)
        return out or default

    def __iter__(self):
        return (k.decode("utf-8", "surrogateescape") for k in self._raw[::2])

    def without(self, names: Iterable[str]) -> "Headers":
        """These headers less ``names`` (case-insensitive)."""
        drop = {n.lower().encode("latin-1") for n in names}
        raw = self._raw
        return Headers(tuple(x for i in range(0, len(raw), 2) if raw[i].lower() not in drop
                             for x in (raw[i], raw[i + 1])))

    def __len__(self) -> int:
        return len(self._raw) // 2

    def items(self):
        return [(k.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape"))
                for k, v in pairs(self._raw)]


# Header names kvgate looks up, lowered and encoded once (they come from code and config: a bounded set).
_LOWER_NAMES: dict[str, bytes] = {}


def _lower_name(name: str) -> bytes:
    lname = name.lower().encode("latin-1")
    if len(_LOWER_NAMES) < 1024:
        _LOWER_NAMES[name] = lname
    return lname


def pairs(flat: tuple) -> tuple:
    """(name, value) pairs of a flat name, value, name, value ... tuple."""
    return tuple(zip(flat[::2], flat[1::2]))


# Common header names and values: one bytes object each, shared by every request that waits, not one per request.
COMMON = {b: b for n in ("Host", "Content-Type", "Content-Length", "User-Agent", "Accept", "Accept-Encoding",
                         "Connection", "Authorization", "X-Session-ID", "X-Request-Id", "keep-alive", "close",
                         "application/json", "*/*", "gzip, deflate", "gzip, deflate, br", "chunked",
                         "text/event-stream") for b in (n.encode(), n.lower().encode())}
# One str per common method, not one per request.
METHODS = {m.encode(): m for m in ("GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH")}
