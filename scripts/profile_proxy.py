"""Where one kvgate arm's CPU goes under load: the bench-proxy chain, wrk, and py-spy's samples, summarised.

Starts one arm of ``kvgate bench-proxy`` (its kvgate, smg and the nginx stand-in; kvgate/bench/proxy_bench.py),
runs wrk against it at CONNECTIONS for SECONDS with the request SHAPE, and prints p50, requests and the arm's
CPU per request. With --sessions N the requests cycle through N session ids (as an RL rollout's many programs
do; bench-proxy itself sends one). With --spy it records py-spy samples meanwhile and prints the frames with
the most samples of their own and inclusive, leaving out the event loop's idle wait.

    .venv/bin/python scripts/profile_proxy.py placement+admission --shape small --seconds 8 --spy
    .venv/bin/python scripts/profile_proxy.py lifecycle+admission --sessions 5000 --policy program

Needs nginx, wrk and smg (as bench-proxy does) and, for --spy, py-spy (``pip install py-spy``; it reads the
process's memory, so it may need root or ptrace permission).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvgate.bench import proxy_bench as pb
from kvgate.tools import procs

# a frame that is the event loop waiting for work, not CPU kvgate spends
_IDLE = ("Runner.run (asyncio/runners.py", "run (uvloop/__init__.py")


def _rotating_script(path: Path, sessions: int) -> None:
    """A wrk script whose small /generate requests carry session ids s0 .. s<sessions-1> in turn."""
    path.write_text(f'''wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local n = 0
request = function()
  n = n + 1
  local s = n % {sessions}
  local body = '{{"input_ids":[' .. s .. ',7920,15839,23758,31677,39596,47515,55434,63353,71272,79191,87110,95029,102948,110867,118786],"session_id":"s' .. s .. '","sampling_params":{{"max_new_tokens":16,"temperature":0}}}}'
  return wrk.format(nil, nil, nil, body)
end
''')


def summarise(raw: Path, own: int, inclusive: int) -> str:
    """py-spy's raw output (one ``frame;frame;... count`` line per stack) as the top frames by own and
    inclusive share of the busy samples."""
    total = 0
    own_c: collections.Counter = collections.Counter()
    incl_c: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if not n.isdigit() or any(frames[-1].startswith(i) for i in _IDLE):
            continue
        total += int(n)
        own_c[frames[-1]] += int(n)
        for f in set(frames):
            incl_c[f] += int(n)
    out = [f"busy samples: {total}"]
    out += [f"{n / total:6.1%} own   {f}" for f, n in own_c.most_common(own)] if total else []
    # frames on every busy stack (the entry point, the loop's run) say nothing: left out
    shared = [f for f, n in incl_c.items() if n == total]
    for f in shared:
        del incl_c[f]
    out += [""] + [f"{n / total:6.1%} incl  {f}" for f, n in incl_c.most_common(inclusive)] if total else []
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arm", choices=[a for a in pb.ALL_ARMS if a != "direct"])
    ap.add_argument("--shape", default="small", choices=["small", "8k", "64k", "sse"])
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--connections", type=int, default=1)
    ap.add_argument("--sessions", type=int, default=0, help="cycle small requests through this many session ids")
    ap.add_argument("--policy", choices=["fifo", "program"], help="admission_policy for an arm with admission")
    ap.add_argument("--spy", action="store_true", help="record py-spy samples and print the top frames")
    ap.add_argument("--top", type=int, default=25, help="frames to print, by own samples (twice as many inclusive)")
    args = ap.parse_args()
    missing = [t for t in ("wrk", "nginx") if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").exists()]
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if args.spy and not Path(spy).exists():
        missing.append("py-spy")
    if missing:
        print(f"profile_proxy: needs {', '.join(missing)}", file=sys.stderr)
        return 3
    if args.policy:
        pb.KVGATE_FLAGS[args.arm] = [*pb.KVGATE_FLAGS.get(args.arm, []), "--admission-policy", args.policy]
    work = Path(tempfile.mkdtemp(prefix="kvgate-profile-"))
    started: list[procs.Proc] = []
    try:
        urls, pgids = pb._start_chain([args.arm], work, started, None)
        script = work / "wrk.lua"
        if args.sessions:
            _rotating_script(script, args.sessions)
        else:
            pb.wrk_script(script, pb.request_body(args.shape), args.shape == "sse")
        url = urls[args.arm] + "/generate"
        conns = f"-c{args.connections}"
        subprocess.run(["wrk", "-t1", conns, "-d2s", "-s", str(script), url], capture_output=True)  # warm
        cpu0 = pb.group_cpu_s(pgids[args.arm]) if args.arm in pgids else None
        rec = None
        if args.spy:
            rec = subprocess.Popen([spy, "record", "-p", str(pgids[args.arm]), "-d", str(args.seconds), "-r", "500",
                                    "-f", "raw", "-o", str(work / "samples.txt")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        text = subprocess.run(["wrk", "-t1", conns, f"-d{args.seconds}s", "--latency", "-s", str(script), url],
                              capture_output=True, text=True).stdout
        r = pb.parse_wrk(text)
        cpu = "" if cpu0 is None else \
            f", CPU per request {(pb.group_cpu_s(pgids[args.arm]) - cpu0) / max(1, r['requests']) * 1e6:.0f} us"
        print(f"{args.arm}, {args.shape if not args.sessions else f'{args.sessions} sessions'}, "
              f"{args.connections} connection(s): {r['requests']:.0f} requests, p50 {r.get('p50_us')} us{cpu}, "
              f"errors {r['errors']:.0f}")
        if rec is not None:
            rec.wait()
            print(summarise(work / "samples.txt", args.top, 2 * args.top))
        return 0
    finally:
        procs.stop_all(started)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
