"""What kvgate's HTTP server costs per request on its own, without sockets: CPU microseconds a request.

For each tree (this one, and any git ref given, unpacked with ``git archive``), a fresh process builds the
tree's ``kvgate.proxy.server.HttpServer`` on a uvloop event loop, gives one connection a stand-in transport
(it counts the bytes written; no socket, no syscall) and then, REQUESTS times: ``data_received`` with one whole
small ``/generate`` request (head and JSON body in one read, as wrk sends it), and two loop turns (the
handler's task runs: it reads the body with ``read_body`` and answers with ``Request.answer``, as the relay
does; then the task's done callback). ``time.process_time`` over the REQUESTS, best of REPS, is one round's
figure for that tree. Rounds interleave the trees (in turn, the order reversed every other round), so a change
in the machine's load falls on all of them alike. Prints each round's us/request per tree, the median of the
rounds, and each tree against the first.

What it leaves out: the kernel's socket work, the event loop's epoll and the relay's upstream call; what it
keeps: the parser's callbacks, the wire rules, the connection's state, the body budget, the request object,
the task per request and the answer's framing (everything kvgate's server adds to a request's CPU).

    .venv/bin/python scripts/bench_server_alone.py --ref ddd7e90 --ref main --rounds 6
    .venv/bin/python scripts/bench_server_alone.py --tree ../other-checkout --rounds 4
    .venv/bin/python scripts/bench_server_alone.py --ref ddd7e90 --instructions --rounds 0   # valgrind only
    .venv/bin/python scripts/bench_server_alone.py --profile     # this tree: cProfile, calls per request

``--body-limit`` gives the server the per-request body limit the gateway gives it (a tree whose server has
none runs without). ``--instructions`` also counts CPU instructions a request under valgrind (cachegrind's
``Ir``, 1,500 requests less 500): deterministic to about 1%, where process time on a shared virtual machine
spreads by tens of percent between runs; it needs valgrind.

Run it under ``flock /tmp/kvgate-heavy.lock`` on a shared machine. The first tree is this script's own
(its repository root); ``--ref`` trees are unpacked into a temporary directory and removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_BODY = (b'{"input_ids":[1,7920,15839,23758,31677,39596,47515,55434,63353,71272,79191,87110,95029,102948,110867,'
         b'118786],"sampling_params":{"max_new_tokens":16,"temperature":0}}')
# What wrk sends for bench-proxy's small /generate (scripts/profile_proxy.py's shape)
REQUEST = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY))
_ANSWER_LINES = b"Content-Type: application/json\r\n"
_ANSWER = b'{"text":"ok","meta_info":{"completion_tokens":16}}'
_ROOT = Path(__file__).resolve().parent.parent


class _Transport:
    """Stands in for the connection's socket transport: counts what is written, never pauses."""

    def __init__(self) -> None:
        self.writes = 0
        self.written = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.written += len(data)

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def is_closing(self) -> bool: return False
    def get_extra_info(self, name, default=None): return default
    def write_eof(self) -> None: ...
    def close(self) -> None: ...


def _child(requests: int, reps: int, profile: bool, body_limit: bool) -> None:
    """In the tree's own process: run ``reps`` repetitions of ``requests`` requests, print a JSON line with
    each repetition's us/request (or, with ``profile``, cProfile's top functions and calls per request).
    body_limit: give the server a per-request body limit as the gateway does (a tree without one ignores it)."""
    import asyncio
    import inspect
    import time

    import uvloop

    from kvgate.proxy import server as srv

    conn_cls = getattr(srv, "Connection", None) or getattr(srv, "_Conn")
    extra = {}
    if body_limit and "body_limit" in inspect.signature(srv.HttpServer).parameters:
        own = {"/close_session", "/finish_session", "/health"}

        def limit(req) -> int:  # kvgate.proxy.admin's body_limit, as the gateway gives it
            path = req.path
            return 1 << 20 if path in own or path.startswith("/kvgate/") else 1 << 30

        extra["body_limit"] = limit

    async def handler(req):
        await req.read_body(1 << 20, 1 << 20, 1 << 20)
        req.answer(200, b"OK", _ANSWER_LINES, _ANSWER, False)

    def route(req):
        return handler

    async def run() -> list[float]:
        server = srv.HttpServer(route, client_max_size=1 << 30, **extra)
        t = _Transport()
        conn = conn_cls(server)
        conn.connection_made(t)
        sleep = asyncio.sleep
        feed = conn.data_received

        async def batch(n: int) -> None:
            for _ in range(n):
                feed(REQUEST)
                await sleep(0)
                await sleep(0)

        await batch(500)  # warm: caches, the first parser
        out = []
        for _ in range(reps):
            w0 = t.writes
            c0 = time.process_time()
            await batch(requests)
            out.append((time.process_time() - c0) / requests * 1e6)
            if t.writes - w0 != requests:
                raise SystemExit(f"{t.writes - w0} answers written for {requests} requests")
        return out

    if profile:
        import cProfile
        import io
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        res = uvloop.run(run())
        pr.disable()
        total = (reps * requests) + 500
        stats = pstats.Stats(pr)
        rows = []
        for (file, line, name), (cc, nc, tt, ct, _) in stats.stats.items():
            rows.append((nc / total, tt / total * 1e6, ct / total * 1e6, f"{Path(file).name}:{line}({name})"))
        rows.sort(key=lambda r: -r[1])
        s = io.StringIO()
        s.write(f"calls/request {sum(r[0] for r in rows):.1f} (all functions cProfile sees)\n")
        s.write(f"{'calls/req':>9} {'own us':>8} {'cum us':>8}  function\n")
        for r in rows[:40]:
            s.write(f"{r[0]:9.2f} {r[1]:8.3f} {r[2]:8.3f}  {r[3]}\n")
        print(json.dumps({"us": res, "profile": s.getvalue()}))
        return
    print(json.dumps({"us": uvloop.run(run())}))


def _child_cmd(requests: int, reps: int, profile: bool, body_limit: bool) -> list[str]:
    return ([sys.executable, str(Path(__file__).resolve()), "--child", "--requests", str(requests),
             "--reps", str(reps)] + (["--profile"] if profile else []) + (["--body-limit"] if body_limit else []))


def _run_tree(tree: Path, requests: int, reps: int, profile: bool = False, body_limit: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), KVGATE_SKIP_ENGINE="1")
    out = subprocess.run(_child_cmd(requests, reps, profile, body_limit), cwd=tree, env=env, capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: exit {out.returncode}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _instructions(tree: Path, body_limit: bool) -> float:
    """CPU instructions a request (valgrind's cachegrind, ``Ir``): the difference between a run of 1,500 and
    one of 500 requests, over 1,000. Deterministic to about 1%, where the process time of a shared virtual
    machine's core spreads by tens of percent; slow (about 10 s a tree)."""
    env = dict(os.environ, PYTHONPATH=str(tree), KVGATE_SKIP_ENGINE="1", PYTHONHASHSEED="0")
    total = {}
    with tempfile.TemporaryDirectory(prefix="bench-server-cg-") as tmp:
        for n in (500, 1500):
            out = Path(tmp) / f"cg.{n}"
            subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}"]
                           + _child_cmd(n, 1, False, body_limit), cwd=tree, env=env, capture_output=True, check=True)
            summary = next(ln for ln in out.read_text().splitlines() if ln.startswith("summary:"))
            total[n] = int(summary.split()[1])
    return (total[1500] - total[500]) / 1000


def _unpack(ref: str, into: Path) -> Path:
    """``ref`` of this script's repository as a directory of files (git archive), its kvgate package only."""
    into.mkdir(parents=True)
    arch = subprocess.run(["git", "-C", str(_ROOT), "archive", ref, "kvgate"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=arch.stdout, check=True)
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", action="append", default=[], help="a git ref to compare (repeatable)")
    ap.add_argument("--tree", action="append", default=[], help="another checkout's root (repeatable)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=20000, help="requests a repetition")
    ap.add_argument("--reps", type=int, default=5, help="repetitions a round (the best counts)")
    ap.add_argument("--profile", action="store_true", help="cProfile this tree's (or the first --tree's) server")
    ap.add_argument("--body-limit", action="store_true",
                    help="give the server a per-request body limit, as the gateway does (trees with one)")
    ap.add_argument("--instructions", action="store_true",
                    help="also count CPU instructions a request under valgrind (deterministic; slow)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a.requests, a.reps, a.profile, a.body_limit)
        return
    if a.profile:
        tree = Path(a.tree[0]) if a.tree else _ROOT
        res = _run_tree(tree, min(a.requests, 5000), 1, profile=True, body_limit=a.body_limit)
        print(res["profile"])
        return
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        trees = [("this", _ROOT)] + [(t, Path(t).resolve()) for t in a.tree]
        trees += [(r, _unpack(r, Path(tmp) / f"ref{i}")) for i, r in enumerate(a.ref)]
        if a.instructions:
            ir = {name: _instructions(tree, a.body_limit) for name, tree in trees}
            print("instructions/request (valgrind Ir): " + ", ".join(f"{n} {v:,.0f}" for n, v in ir.items()))
            for name, _ in trees[1:]:
                print(f"{trees[0][0]} against {name}: {ir[trees[0][0]] / ir[name]:.3f}x")
        best: dict[str, list[float]] = {name: [] for name, _ in trees}
        if a.rounds <= 0:
            return
        print(f"us/request (CPU), best of {a.reps} x {a.requests} requests, per round:")
        print("round " + " ".join(f"{name:>10}" for name, _ in trees))
        for r in range(a.rounds):
            order = trees if r % 2 == 0 else trees[::-1]  # ABBA: neither side always runs first
            for name, tree in order:
                best[name].append(min(_run_tree(tree, a.requests, a.reps, body_limit=a.body_limit)["us"]))
            print(f"{r + 1:5d} " + " ".join(f"{best[name][-1]:10.2f}" for name, _ in trees), flush=True)
        first = trees[0][0]
        med = {name: statistics.median(v) for name, v in best.items()}
        print("median " + " ".join(f"{med[name]:9.2f}" for name, _ in trees))
        print("min    " + " ".join(f"{min(best[name]):9.2f}" for name, _ in trees))
        for name, _ in trees[1:]:
            ratios = [x / y for x, y in zip(best[first], best[name])]
            print(f"{first} against {name}: {med[first]:.2f} against {med[name]:.2f} us/request "
                  f"(median of the rounds' ratios {statistics.median(ratios):.3f}x, "
                  f"range {min(ratios):.3f}-{max(ratios):.3f}x)")


if __name__ == "__main__":
    main()
