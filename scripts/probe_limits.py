"""Measure the client-side limits of an HTTP/1.1 front end: smg 1.13, nginx (stock limits) and kvgate.

Starts a simulated engine (kvgate sim-engine), smg 1.13 in front of it (``python -m smg launch``), nginx as a
plain reverse proxy in front of it with nginx's default limits, and kvgate (this tree) in front of smg; then
sends each the same raw bytes and prints one table (markdown) of what each answered: how many headers, how
large a header line, a request line, a trailer section and a declared body each takes, how long each waits
for a head, a body, an idle connection, and how each answers Upgrade, absolute-form, HTTP/1.0 + chunked, a
request line without a version, HTTP/2.0, CONNECT, and pipelined requests before a malformed one.

    .venv/bin/python scripts/probe_limits.py                 # about 2.5 minutes (the timeouts run at once)
    .venv/bin/python scripts/probe_limits.py --no-timeouts   # skip the waits (about 20 s)
    .venv/bin/python scripts/probe_limits.py --kvgate-src /path/to/other/checkout   # kvgate from another tree

Everything listens on 127.0.0.1; every process runs in its own process group and is stopped by its id.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from pathlib import Path

from kvgate.tools import procs

GEN = b'{"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":1}}'


async def exchange(port: int, raw: bytes, wait_s: float = 5.0, send_all: bool = True) -> tuple[bytes, float, bool]:
    """Send ``raw``, read until the peer closes or ``wait_s`` passes. Returns (bytes read, seconds until
    the first byte or the close, whether the peer closed)."""
    r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
    t0 = time.perf_counter()
    try:
        view = memoryview(raw)
        for i in range(0, len(raw), 1 << 20):
            w.write(view[i:i + (1 << 20)])
            try:
                await w.drain()
            except ConnectionError:
                break
    except ConnectionError:
        pass
    out = bytearray()
    first = None
    closed = False
    deadline = t0 + wait_s
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        try:
            chunk = await asyncio.wait_for(r.read(1 << 16), left)
        except (asyncio.TimeoutError, TimeoutError):
            break
        except ConnectionError:
            closed = True
            break
        if first is None:
            first = time.perf_counter() - t0
        if not chunk:
            closed = True
            break
        out += chunk
    w.close()
    return bytes(out), first if first is not None else time.perf_counter() - t0, closed


def statuses(raw: bytes) -> list[int]:
    """Every status code in ``raw`` (answers on one connection), in order."""
    return [int(m.group(1)) for m in re.finditer(rb"HTTP/1\.[01] (\d{3}) ", raw)]


def status(raw: bytes) -> int | None:
    s = statuses(raw)
    return s[0] if s else None


async def largest_passing(port: int, make, lo: int, hi: int) -> tuple[int, int | None]:
    """Binary search the largest n in [lo, hi] for which ``make(n)`` is answered below 400. Returns (n, the
    status of n + 1 step's refusal) or (hi, None) when hi passes."""
    async def ok(n):
        raw, _, _ = await exchange(port, make(n), wait_s=20)
        st = status(raw)
        return st is not None and st < 400, st
    good, st = await ok(hi)
    if good:
        return hi, None
    refused = st
    while hi - lo > max(1, lo // 100):  # within 1%
        mid = (lo + hi) // 2
        good, st = await ok(mid)
        if good:
            lo = mid
        else:
            hi, refused = mid, st
    return lo, refused


def headers_req(n: int) -> bytes:
    return b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(n)) + \
        b"Connection: close\r\n\r\n"


def field_req(n: int) -> bytes:
    return b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * n + b"\r\nConnection: close\r\n\r\n"


def url_req(n: int) -> bytes:
    return b"GET /health?" + b"a" * n + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def trailer_req(n: int) -> bytes:
    lines = b"".join(b"X-T%d: %s\r\n" % (i, b"a" * 1000) for i in range(n // 1000))
    return (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n%x\r\n%s\r\n0\r\n%s\r\n" % (len(GEN), GEN, lines))


async def declared_body(port: int, n: int) -> str:
    """A head declaring an n-byte body, nothing sent after it: what comes back within 3 s."""
    raw, t, closed = await exchange(port, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                          b"Content-Length: %d\r\n\r\n" % n, wait_s=3)
    st = status(raw)
    return f"{st} after {t * 1000:.0f} ms" if st else ("closed" if closed else "waits")


async def wait_probe(port: int, raw: bytes, cap_s: float) -> str:
    out, t, closed = await exchange(port, raw, wait_s=cap_s)
    st = status(out)
    if st is None and not closed:
        return f"waits > {cap_s:.0f} s"
    return f"{st or 'closed'} after {t:.1f} s"


async def pipelined(port: int, tail: bytes) -> str:
    good = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    out, _, closed = await exchange(port, good + good + tail, wait_s=5)
    return " ".join(map(str, statuses(out))) + (", closed" if closed else ", open")


async def probe(port: int, timeouts: bool, cap_s: float) -> dict[str, str]:
    res: dict[str, str] = {}
    n, st = await largest_passing(port, headers_req, 1, 400_000)
    res["headers (count)"] = f"{n} pass" + (f", more: {st}" if st else "")
    n, st = await largest_passing(port, field_req, 1, 4 << 20)
    res["one header line (bytes)"] = f"{n} pass" + (f", more: {st}" if st else "")
    n, st = await largest_passing(port, url_req, 1, 1 << 20)
    res["request line (bytes)"] = f"{n} pass" + (f", more: {st}" if st else "")
    n, st = await largest_passing(port, trailer_req, 1000, 64 << 20)
    res["trailer section (bytes)"] = f"{n} pass" + (f", more: {st}" if st else "")
    for size in (1 << 20, (1 << 20) + 1, 2 << 20, 256 << 20, (256 << 20) + 1, 512 << 20, (512 << 20) + 1, 1 << 30):
        res[f"declared body {size} bytes"] = await declared_body(port, size)
    h2c = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: Upgrade, HTTP2-Settings\r\n"
           b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nContent-Length: %d\r\n\r\n%s" % (len(GEN), GEN))
    out, _, _ = await exchange(port, h2c, wait_s=5)
    res["Upgrade: h2c with a body"] = f"{status(out)}, body {'kept' if b'meta_info' in out else 'lost'}"
    out, _, _ = await exchange(port, b"POST http://127.0.0.1:%d/generate HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                     b"application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                               % (port, len(GEN), GEN), wait_s=5)
    res["absolute-form POST /generate"] = f"{status(out)}"
    out, _, closed = await exchange(port, b"POST /generate HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n"
                                          b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                                          b"%x\r\n%s\r\n0\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                                    % (len(GEN), GEN), wait_s=3)
    res["HTTP/1.0 + chunked, keep-alive, then a GET"] = (" ".join(map(str, statuses(out))) or "-") + \
        (", closed" if closed else ", open")
    for name, line in (("no version", b"GET /health\r\n\r\n"), ("HTTP/2.0", b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n"),
                       ("HTTP/1.2", b"GET /health HTTP/1.2\r\nHost: x\r\n\r\n"),
                       ("CONNECT", b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nHost: 127.0.0.1:1\r\n\r\n"),
                       ("OPTIONS *", b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")):
        out, _, closed = await exchange(port, line, wait_s=3)
        res[f"request line: {name}"] = f"{status(out) or '-'}" + (", closed" if closed else ", open")
    res["pipelined: 2 valid, then a malformed line"] = await pipelined(port, b"BAD\x01 / HTTP/1.1\r\n\r\n")
    res["pipelined: 2 valid, then a bad chunk"] = await pipelined(
        port, b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
    res["pipelined: GET, GET + close, then bytes"] = await pipelined(
        port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sid = b"s" * (1 << 20)
    body = b'{"session_id":"%s","input_ids":[1,2,3],"sampling_params":{"max_new_tokens":1}}' % sid
    out, _, _ = await exchange(port, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                     b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body), wait_s=10)
    res["generate with a 1 MiB session_id"] = f"{status(out)}"
    if timeouts:
        waits = await asyncio.gather(
            wait_probe(port, b"GET /health HTTP/1.1\r\nHost: x\r\n", cap_s),
            wait_probe(port, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n{\"a\"", cap_s),
            wait_probe(port, b"", cap_s))
        res["head sent in part, then nothing"] = waits[0]
        res["body sent in part, then nothing"] = waits[1]
        res["connection with nothing sent"] = waits[2]
    return res


def nginx_conf(port: int, upstream_port: int, w: Path) -> str:
    # nginx's own defaults for every client limit: nothing set but where files go and the upstream.
    return f"""daemon off;
master_process off;
worker_processes 1;
pid {w}/nginx.pid;
error_log {w}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {w}/body;
  proxy_temp_path {w}/proxy;
  server {{
    listen 127.0.0.1:{port};
    location / {{ proxy_pass http://127.0.0.1:{upstream_port}; proxy_http_version 1.1; }}
  }}
}}
"""


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-timeouts", action="store_true", help="skip the head, body and idle waits")
    ap.add_argument("--cap-s", type=float, default=130.0, help="longest wait for a timeout probe, seconds")
    ap.add_argument("--only", nargs="*", default=["smg", "nginx", "kvgate"], help="which front ends")
    ap.add_argument("--kvgate-src", default=None, help="run kvgate from this source tree (PYTHONPATH)")
    ap.add_argument("--kvgate-flags", nargs="*", default=["--agentic-session-lifecycle"])
    args = ap.parse_args()
    started: list[procs.Proc] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-probe-") as d:
        w = Path(d)
        try:
            eng = procs.free_port()
            started.append(procs.start("engine", [sys.executable, "-m", "kvgate", "sim-engine", "--port", str(eng),
                                                  "--max-total-num-tokens", "200000"], w))
            await asyncio.to_thread(procs.wait_http, f"http://127.0.0.1:{eng}/health", 60, started[-1])
            fronts: dict[str, int] = {}
            smg = procs.free_port()
            started.append(procs.start("smg", procs.smg_command(smg, [f"http://127.0.0.1:{eng}"], procs.free_port()), w))
            await asyncio.to_thread(procs.wait_http, f"http://127.0.0.1:{smg}/readiness", 60, started[-1],
                                    procs.router_ready(1))
            if "smg" in args.only:
                fronts["smg"] = smg
            if "nginx" in args.only:
                ng = procs.free_port()
                (w / "nginx.conf").write_text(nginx_conf(ng, eng, w))
                nginx = procs.find_executable("nginx") or "/usr/sbin/nginx"
                started.append(procs.start("nginx", [nginx, "-c", str(w / "nginx.conf"), "-p", str(w)], w))
                await asyncio.to_thread(procs.wait_http, f"http://127.0.0.1:{ng}/health", 30, started[-1])
                fronts["nginx"] = ng
            if "kvgate" in args.only:
                kv = procs.free_port()
                env = {"PYTHONPATH": args.kvgate_src} if args.kvgate_src else None
                started.append(procs.start("kvgate", [sys.executable, "-m", "kvgate", "serve", "--upstream",
                                                      f"http://127.0.0.1:{smg}", "--port", str(kv),
                                                      "--no-compat-probe", *args.kvgate_flags], w, env=env,
                                           cwd=Path(args.kvgate_src) if args.kvgate_src else None))
                await asyncio.to_thread(procs.wait_http, f"http://127.0.0.1:{kv}/kvgate/health", 30, started[-1])
                fronts["kvgate"] = kv
            results = await asyncio.gather(*(probe(p, not args.no_timeouts, args.cap_s) for p in fronts.values()))
        finally:
            procs.stop_all(started)
    names = list(fronts)
    print("| probe | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for key in results[0]:
        print(f"| {key} | " + " | ".join(r.get(key, "") for r in results) + " |")


if __name__ == "__main__":
    asyncio.run(main())
