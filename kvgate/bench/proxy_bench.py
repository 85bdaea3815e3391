"""``kvgate bench-proxy``: what each proxy hop costs, with the engines replaced by a stand-in that costs ~nothing.

Chain: wrk (load generator, C) -> [kvgate] -> smg -> nginx answering fixed SGLang /generate JSON or SSE. Arms:
direct (wrk -> nginx), smg, and one kvgate process per feature set (off, lifecycle, lifecycle + admission, and
with kvgate placing sessions, lifecycle with and without admission, when this kvgate has it), all started once
and measured in interleaved rounds (the arm order rotates each round). Per round and request shape: p50 latency at one connection (wrk --latency), and for the
throughput shapes the max req/s at many connections plus the proxy process group's CPU per request
(/proc/<pid>/stat utime + stime). Writes DIR/proxy-bench.json and DIR/proxy-bench.md (kvgate/bench/proxy_report.py).

Needs nginx and wrk (Debian: apt-get install nginx-light wrk; scripts/setup.sh installs them when it can) and
smg; ``run`` returns 3 with one line when one is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from kvgate.bench.proxy_report import DIRECT, NULL_PROXY, PLACING, SMG, Sample, markdown, summarise
from kvgate.tools import procs

#: The stand-in engine's capacity (tokens): large enough that admission never holds a benchmark request.
STANDIN_MAX_TOTAL_NUM_TOKENS = 1_000_000_000
#: Completion tokens each answer claims (the fixed answer's meta_info).
COMPLETION_TOKENS = 16
#: Prompt tokens per shape; "sse" is the small prompt with "stream": true.
SHAPE_TOKENS = {"small": 16, "8k": 8192, "64k": 65536, "sse": 16}
#: Requests whose x-request-id starts with this get the SSE answer (smg forwards x-request-id; it parses
#: and re-serialises the body, so the stand-in cannot read "stream" from it).
SSE_REQUEST_ID = "sse-bench"

ALL_ARMS = ("direct", "smg", "nginx-proxy", "kvgate-off", "lifecycle", "lifecycle+admission", "placement",
            "placement+admission", "defaults+admission", "kvgate-nosmg")
# The lifecycle arms keep smg on the path (session_placement router). The placement arms have kvgate place the
# sessions and skip smg (session_placement kvgate); defaults+admission is both features with every placement key
# at its default (auto places session traffic when a feature is on, so it should measure as placement+admission).
KVGATE_FLAGS = {
    "kvgate-off": [],
    "lifecycle": ["--agentic-session-lifecycle", "--session-placement", "router"],
    "lifecycle+admission": ["--agentic-session-lifecycle", "--agentic-program-admission",
                            "--admission-poll-interval-s", "0.5", "--session-placement", "router"],
    "placement": ["--agentic-session-lifecycle", "--session-placement", "kvgate"],
    # both features with kvgate placing sessions
    "placement+admission": ["--agentic-session-lifecycle", "--agentic-program-admission",
                            "--admission-poll-interval-s", "0.5", "--session-placement", "kvgate"],
    "defaults+admission": ["--agentic-session-lifecycle", "--agentic-program-admission",
                           "--admission-poll-interval-s", "0.5"],
    # features off, in front of the stand-in itself: kvgate's own hop without smg's (smg's SSE path stalls a
    # keep-alive client like wrk for a delayed ACK, ~40 ms a stream; kvgate's client to smg does not)
    "kvgate-nosmg": ["--no-compat-probe"],
}


def generate_answer(prompt_tokens: int) -> bytes:
    """A fixed SGLang /generate answer (srt/entrypoints/http_server.py shape: text, output_ids, meta_info)."""
    return json.dumps({"text": " ok" * COMPLETION_TOKENS, "output_ids": list(range(1, COMPLETION_TOKENS + 1)),
                       "meta_info": {"id": "bench", "finish_reason": {"type": "length", "length": COMPLETION_TOKENS},
                                     "prompt_tokens": prompt_tokens, "completion_tokens": COMPLETION_TOKENS,
                                     "cached_tokens": 0, "e2e_latency": 0.001}},
                      separators=(",", ":")).encode()


def sse_answer(prompt_tokens: int) -> bytes:
    """A fixed SGLang /generate SSE stream: a few ``data:`` events, then ``data: [DONE]``."""
    events = []
    for i in (1, COMPLETION_TOKENS // 2, COMPLETION_TOKENS):
        done = i == COMPLETION_TOKENS
        events.append(json.dumps({
            "text": " ok" * i, "output_ids": list(range(1, i + 1)),
            "meta_info": {"id": "bench", "finish_reason": {"type": "length", "length": i} if done else None,
                          "prompt_tokens": prompt_tokens, "completion_tokens": i, "cached_tokens": 0}},
            separators=(",", ":")))
    return "".join(f"data: {e}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


def request_body(shape: str) -> bytes:
    """The benchmark's request body for ``shape``: input_ids of SHAPE_TOKENS[shape] token ids, a top-level
    session_id (what an RL rollout sends), max_new_tokens = COMPLETION_TOKENS, and "stream" for sse."""
    n = SHAPE_TOKENS[shape]
    body = {"input_ids": [(i * 7919) % 150000 + 1 for i in range(n)], "session_id": f"bench-{shape}",
            "sampling_params": {"max_new_tokens": COMPLETION_TOKENS, "temperature": 0}}
    if shape == "sse":
        body["stream"] = True
    return json.dumps(body, separators=(",", ":")).encode()


def _nginx_str(data: bytes) -> str:
    return "'" + data.decode().replace("\\", "\\\\").replace("'", "\\'") + "'"


def nginx_config(port: int, workdir: Path, token_usage: float = 0.0) -> str:
    """An nginx.conf for a single-process stand-in engine on 127.0.0.1:``port`` (what smg and kvgate call:
    docs/compatibility.md): /health, server and model info, /v1/loads with a huge KV pool (``token_usage``
    full: 0.99 holds every request in admission), and POST
    /generate answered with fixed JSON (or SSE for x-request-id SSE_REQUEST_ID*). Bodies are read and dropped."""
    w = str(workdir)
    loads = json.dumps({"loads": [{"dp_rank": 0, "num_used_tokens": int(token_usage * STANDIN_MAX_TOTAL_NUM_TOKENS),
                                   "token_usage": token_usage,
                                   "max_total_num_tokens": STANDIN_MAX_TOTAL_NUM_TOKENS, "num_reqs": 0,
                                   "num_waiting_reqs": 0}]}).encode()
    server_info = json.dumps({"model_path": "", "tokenizer_path": None, "version": "0.5.17",
                              "max_total_num_tokens": STANDIN_MAX_TOTAL_NUM_TOKENS, "enable_metrics": True,
                              "disaggregation_mode": "null", "dp_size": 1}).encode()
    model_info = json.dumps({"model_path": "", "tokenizer_path": None, "is_generation": True,
                             "model_type": "llama", "architectures": ["LlamaForCausalLM"]}).encode()
    return f"""daemon off;
master_process off;
worker_processes 1;
pid {w}/nginx.pid;
error_log {w}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {w}/body;
  proxy_temp_path {w}/proxy;
  client_max_body_size 0;
  client_body_buffer_size 4m;
  keepalive_requests 100000000;
  keepalive_timeout 600s;
  server {{
    listen 127.0.0.1:{port} reuseport;
    default_type application/json;
    location = /health {{ return 200 ''; }}
    location = /health_generate {{ return 200 ''; }}
    location = /server_info {{ return 200 {_nginx_str(server_info)}; }}
    location = /get_server_info {{ return 200 {_nginx_str(server_info)}; }}
    location = /model_info {{ return 200 {_nginx_str(model_info)}; }}
    location = /get_model_info {{ return 200 {_nginx_str(model_info)}; }}
    location = /v1/loads {{ return 200 {_nginx_str(loads)}; }}
    location = /metrics {{ default_type text/plain; return 200 ''; }}
    location = /generate {{
      if ($http_x_request_id ~ "^{SSE_REQUEST_ID}") {{ rewrite ^ /_sse last; }}
      return 200 {_nginx_str(generate_answer(SHAPE_TOKENS['small']))};
    }}
    location = /_sse {{ internal; default_type text/event-stream; return 200 {_nginx_str(sse_answer(SHAPE_TOKENS['sse']))}; }}
    location / {{ return 404 '{{"error":{{"message":"not found"}}}}'; }}
  }}
}}
"""


def null_proxy_config(port: int, upstream: str, workdir: Path, connections: int = 64) -> str:
    """An nginx.conf for the ``nginx-proxy`` arm: a reverse proxy on 127.0.0.1:``port`` in front of
    ``upstream`` (host:port, smg), one worker process as kvgate has one, kept-alive upstream connections,
    bodies streamed both ways (no buffering), room for ``connections`` clients (each also holds a
    connection to smg, and upstream connections past the kept-alive ones close under load). It does no
    work of its own, so what it adds is the floor any extra hop in front of smg pays on this machine: the
    context switches and wake-ups of one more process."""
    w = str(workdir)
    room = max(4096, 4 * connections + 1024)  # a client's, its upstream's, and upstream ones still closing
    return f"""daemon off;
master_process off;
worker_processes 1;
pid {w}/null-proxy.pid;
error_log {w}/null-proxy-error.log warn;
worker_rlimit_nofile {room + 64};
events {{ worker_connections {room}; }}
http {{
  access_log off;
  client_body_temp_path {w}/null-proxy-body;
  proxy_temp_path {w}/null-proxy-temp;
  client_max_body_size 0;
  keepalive_requests 100000000;
  keepalive_timeout 600s;
  upstream router {{ server {upstream}; keepalive 256; keepalive_requests 100000000; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://router;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"""


def wrk_script(path: Path, body: bytes, sse: bool) -> None:
    """A wrk Lua script that POSTs ``body`` as JSON (and the SSE request id when ``sse``)."""
    headers = 'wrk.headers["Content-Type"] = "application/json"\n'
    if sse:
        headers += f'wrk.headers["X-Request-Id"] = "{SSE_REQUEST_ID}"\n'
    path.write_text(f'wrk.method = "POST"\n{headers}wrk.body = [==[{body.decode()}]==]\n')


_UNITS = {"us": 1.0, "ms": 1000.0, "s": 1_000_000.0}


def parse_wrk(text: str) -> dict[str, float]:
    """From wrk --latency output: p50_us, rps, requests, errors (non-2xx + socket errors). Raises ValueError
    when the output has no request count."""
    out: dict[str, float] = {"errors": 0.0}
    m = re.search(r"^\s+50%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
    if m:
        out["p50_us"] = float(m.group(1)) * _UNITS[m.group(2)]
    m = re.search(r"^\s*(\d+) requests in", text, re.M)
    if not m:
        raise ValueError(f"wrk output without a request count: {text[-500:]!r}")
    out["requests"] = float(m.group(1))
    m = re.search(r"^Requests/sec:\s+([\d.]+)", text, re.M)
    out["rps"] = float(m.group(1)) if m else 0.0
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    if m:
        out["errors"] += float(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    if m:
        out["errors"] += sum(float(x) for x in m.groups())
    return out


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by every live process in process group ``pgid`` and by every
    descendant of its leader (``kvgate serve --workers N`` starts its workers in process groups of their own):
    :func:`kvgate.tools.procs.group_cpu_seconds`."""
    return procs.group_cpu_seconds([pgid]).get(pgid, 0.0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="proxy-bench", help="output directory (created): proxy-bench.json and .md")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the report gives medians")
    p.add_argument("--latency-s", type=int, default=2, help="seconds per latency run (one connection)")
    p.add_argument("--throughput-s", type=int, default=3, help="seconds per throughput run")
    p.add_argument("--connections", type=int, default=64, help="connections of a throughput run")
    p.add_argument("--arms", nargs="+", default=list(ALL_ARMS), choices=ALL_ARMS,
                   help="arms to run (direct and smg are always run: ratios need them)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPE_TOKENS), choices=list(SHAPE_TOKENS),
                   help="request shapes measured at one connection")
    p.add_argument("--waiters", type=int, default=0, metavar="N",
                   help="instead of the table: hold N small requests in admission (the stand-in reports a full KV "
                        "pool) and report kvgate's RSS before, while they wait, and after they leave")
    p.add_argument("--sessions", type=int, default=0, metavar="N",
                   help="instead of the table: open N sessions through real /generate calls (lifecycle, admission "
                        "and kvgate's session placement on; each session a distinct 128-token prompt) and report "
                        "kvgate's RSS before and with N sessions tracked")
    p.add_argument("--baseline", metavar="DIR",
                   help="another kvgate source tree (e.g. a git worktree of main): its kvgate arms run in the "
                        "same rounds as 'ARM@base' (with --workers, also as 'ARM-wN@base'), for before/after "
                        "figures from one run")
    p.add_argument("--workers", nargs="+", type=int, default=[], metavar="N",
                   help="also run each kvgate arm as ARM-wN: `kvgate serve --workers N` with state_backend: redis "
                        "(a redis-server is started; N = 1 gives the one-process figure on the same backend)")
    p.add_argument("--throughput-shapes", nargs="*", default=["small"], choices=list(SHAPE_TOKENS),
                   help="request shapes also measured at --connections connections")


def missing_tools() -> str | None:
    """None when nginx, wrk and smg are all there, else the one line saying what to install."""
    if procs.find_executable("nginx") is None and not Path("/usr/sbin/nginx").exists():
        return "nginx not found (Debian: apt-get install nginx-light)"
    if shutil.which("wrk") is None:
        return "wrk not found (Debian: apt-get install wrk)"
    if not procs.smg_installed():
        return "the smg router is not installed (pip install smg)"
    return None


def _placement_available() -> bool:
    from kvgate.config import KEYS
    return any(k.name == "session_placement" for k in KEYS)


def run(args: argparse.Namespace) -> int:
    """Start the stand-in, smg and the kvgate arms, measure, write the report. 0 ok, 1 errors seen, 2 bad
    arguments, 3 a tool is missing."""
    why = missing_tools()
    if why is not None:
        print(f"kvgate bench-proxy: skipped: {why}", file=sys.stderr)
        return 3
    if args.rounds < 1 or args.latency_s < 1 or args.throughput_s < 1 or args.connections < 1:
        print("kvgate bench-proxy: --rounds, --latency-s, --throughput-s and --connections must be >= 1",
              file=sys.stderr)
        return 2
    if getattr(args, "waiters", 0):
        return _run_waiters(args)
    if getattr(args, "sessions", 0):
        return _run_sessions(args)
    arms = [a for a in ALL_ARMS if a in (DIRECT, SMG) or a in args.arms]
    placing = [a for a in arms if a in PLACING]
    if placing and not _placement_available():
        print("kvgate bench-proxy: this kvgate has no session_placement key; the placement arms are left out",
              file=sys.stderr)
        arms = [a for a in arms if a not in placing]
    baseline = getattr(args, "baseline", None)
    if baseline:
        if not Path(baseline, "kvgate", "__init__.py").exists():
            print(f"kvgate bench-proxy: --baseline: {baseline} has no kvgate package", file=sys.stderr)
            return 2
        # a baseline tree from before kvgate placed sessions has no placing arms
        base_places = '"session_placement"' in Path(baseline, "kvgate", "config.py").read_text(errors="replace")
        arms += [f"{a}@base" for a in arms if a not in (DIRECT, SMG, NULL_PROXY, "kvgate-nosmg")
                 and (a not in PLACING or base_places)]
    workers = sorted(set(getattr(args, "workers", None) or []))
    if any(n < 1 for n in workers):
        print("kvgate bench-proxy: --workers must be >= 1", file=sys.stderr)
        return 2
    if workers and procs.find_executable("redis-server") is None and not Path("/usr/bin/redis-server").exists():
        print("kvgate bench-proxy: skipped: --workers needs redis-server (Debian: apt-get install redis-server)",
              file=sys.stderr)
        return 3
    arms = with_worker_arms(arms, workers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvgate-proxy-bench-"))
    started: list[procs.Proc] = []
    try:
        urls, pgids = _start_chain(arms, work, started, baseline, args.connections)
        scripts = {}
        for shape in set(args.shapes) | set(args.throughput_shapes):
            scripts[shape] = work / f"{shape}.lua"
            wrk_script(scripts[shape], request_body(shape), shape == "sse")
        samples: list[Sample] = []
        for arm in arms:  # warm every path once (connections, first-request costs)
            _wrk(urls[arm], scripts[args.shapes[0]], 1, 1)
        t_start = time.monotonic()
        for rnd in range(args.rounds):
            order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
            for shape in args.shapes:
                for arm in order:
                    if arm == NULL_PROXY and shape == "sse":
                        # smg's delayed-ACK stall (see docs/performance.md) lands on nginx's kept-alive
                        # connection to smg as it does on wrk's: its SSE figure would be smg's stall, no hop's
                        continue
                    cpu0 = group_cpu_s(pgids[arm]) if arm in pgids else None
                    r = _wrk(urls[arm], scripts[shape], 1, args.latency_s)
                    cpu = None
                    if cpu0 is not None and r["requests"] > 0:
                        cpu = (group_cpu_s(pgids[arm]) - cpu0) / r["requests"] * 1e6
                    samples.append(Sample(rnd, arm, shape, "latency", p50_us=r.get("p50_us"), cpu_us_per_req=cpu,
                                          requests=int(r["requests"]), errors=int(r["errors"])))
            for shape in args.throughput_shapes:
                for arm in order:
                    cpu0 = group_cpu_s(pgids[arm]) if arm in pgids else None
                    r = _wrk(urls[arm], scripts[shape], args.connections, args.throughput_s)
                    cpu = None
                    if cpu0 is not None and r["requests"] > 0:
                        cpu = (group_cpu_s(pgids[arm]) - cpu0) / r["requests"] * 1e6
                    samples.append(Sample(rnd, arm, shape, "throughput", rps=r["rps"], cpu_us_per_req=cpu,
                                          requests=int(r["requests"]), errors=int(r["errors"])))
            print(f"kvgate bench-proxy: round {rnd + 1}/{args.rounds} done ({time.monotonic() - t_start:.0f} s)",
                  file=sys.stderr, flush=True)
        summary = summarise(samples)
        backend = {}
        for arm in arms:
            if WORKERS_ARM.search(arm.partition("@")[0]):
                backend[arm] = backend_figures(procs.wait_http(urls[arm] + "/metrics", 30).decode())
        meta = {"rounds": args.rounds, "latency run": f"{args.latency_s} s at 1 connection",
                "throughput run": f"{args.throughput_s} s at {args.connections} connections",
                "upstream": "nginx with fixed answers", "smg": _smg_version(), "cpus": os.cpu_count()}
        md = markdown(summary, meta)
        if backend:
            md += "\nShared state (Redis) of the worker arms over the run: " + "; ".join(
                f"{arm} {b['bypass']:.0f} calls fell back"
                + (f", {b['ops']:.0f} ops in {b['calls']:.0f} batched calls" if "calls" in b else "")
                for arm, b in backend.items()) + ".\n"
        (out / "proxy-bench.md").write_text(md)
        (out / "proxy-bench.json").write_text(json.dumps(
            {"meta": meta, "arms": arms, "summary": summary.to_json(), "backend": backend,
             "samples": [asdict(s) for s in samples]},
            indent=1))
        print(md)
        print(f"kvgate bench-proxy: wrote {out / 'proxy-bench.md'} and {out / 'proxy-bench.json'}", file=sys.stderr)
        return 1 if summary.errors else 0
    finally:
        procs.stop_all(started)
        shutil.rmtree(work, ignore_errors=True)


def with_worker_arms(arms: list[str], workers: list[int]) -> list[str]:
    """``arms`` followed by "ARM-wN" for each kvgate arm and each N in ``workers``; a baseline arm ("ARM@base")
    gets "ARM-wN@base", so the baseline's scaling is measured in the same rounds as this tree's."""
    return arms + [f"{name}-w{n}{at}{tag}" for name, at, tag in (a.partition("@") for a in arms)
                   if name in KVGATE_FLAGS for n in workers]


def _smg_version() -> str:
    try:
        import importlib.metadata as md
        return md.version("smg")
    except Exception:
        return "?"


def _start_chain(arms: list[str], work: Path, started: list[procs.Proc],
                 baseline: str | None = None, connections: int = 64) -> tuple[dict[str, str], dict[str, int]]:
    """Start nginx, smg and one kvgate per kvgate arm ("ARM@base" arms from the ``baseline`` source tree);
    return (arm -> base URL, arm -> process group id)."""
    nport = procs.free_port()
    conf = work / "nginx.conf"
    conf.write_text(nginx_config(nport, work))
    nginx = procs.find_executable("nginx") or "/usr/sbin/nginx"
    ng = procs.start("nginx", [nginx, "-p", str(work), "-c", str(conf)], work, url=f"http://127.0.0.1:{nport}")
    started.append(ng)
    procs.wait_http(ng.url + "/health", 30, ng)
    rport, mport = procs.free_port(), procs.free_port()
    router = procs.start("smg", procs.smg_command(rport, [ng.url], mport, policy="round_robin"), work,
                         url=f"http://127.0.0.1:{rport}")
    started.append(router)
    procs.wait_http(router.url + "/readiness", 60, router, procs.router_ready(1))
    urls = {DIRECT: ng.url, SMG: router.url}
    pgids = {SMG: router.popen.pid}
    redis_url = _start_redis(work, started) if any(WORKERS_ARM.search(a) for a in arms) else None
    if NULL_PROXY in arms:
        pport = procs.free_port()
        pconf = work / "null-proxy.conf"
        pconf.write_text(null_proxy_config(pport, router.url.split("//", 1)[1], work, connections))
        proxy = procs.start(NULL_PROXY, [nginx, "-p", str(work), "-c", str(pconf)], work,
                            url=f"http://127.0.0.1:{pport}")
        started.append(proxy)
        procs.wait_http(proxy.url + "/readiness", 30, proxy)  # through to smg
        urls[NULL_PROXY], pgids[NULL_PROXY] = proxy.url, proxy.popen.pid
    for arm in arms:
        if arm in (DIRECT, SMG, NULL_PROXY):
            continue
        kport = procs.free_port()
        name, _, tag = arm.partition("@")
        m = WORKERS_ARM.search(name)
        n_workers = int(m.group(1)) if m else None
        if m:
            name = name[:m.start()]
        # the baseline's package directory goes first on sys.path (ahead of the installed kvgate and the cwd)
        entry = (["-c", f"import sys; sys.path.insert(0, {str(Path(baseline).resolve())!r}); "
                        "from kvgate.cli import main; sys.exit(main())"] if tag else ["-m", "kvgate"])
        upstream = ng.url if name == "kvgate-nosmg" else router.url
        cmd = [sys.executable, *entry, "serve", "--upstream", upstream, "--port", str(kport),
               "--log-level", "warning", *KVGATE_FLAGS[name]]
        if name == "kvgate-nosmg":
            cmd += ["--engines", ng.url]
        if n_workers is not None:  # one redis key prefix per arm: the arms share one redis-server
            cmd += ["--workers", str(n_workers), "--state-backend", "redis", "--redis-url", redis_url,
                    "--redis-key-prefix", f"{arm}:"]
        # The tree's package also for the processes it starts (the workers of --workers run `python -m kvgate`):
        # on PYTHONPATH, run from the work directory (`-m` puts the current directory first on sys.path).
        tree = Path(baseline).resolve() if tag else Path(__file__).resolve().parents[2]
        kv = procs.start(f"kvgate-{arm.replace('+', '-')}", cmd, work, url=f"http://127.0.0.1:{kport}",
                         env={"PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))},
                         cwd=work)
        started.append(kv)
        if n_workers is not None and n_workers > 1:  # every worker up, with its engines and (admission) its ledger
            procs.wait_http(kv.url + "/metrics", 60, kv,
                            lambda st, body, n=n_workers, adm="--agentic-program-admission" in KVGATE_FLAGS[name]:
                            st == 200 and workers_ready(body.decode(), n, adm))
        elif name == "kvgate-nosmg":  # no router to list engines: ready when it answers
            procs.wait_http(kv.url + "/kvgate/health", 30, kv)
        else:
            procs.wait_http(kv.url + "/kvgate/engines", 30, kv,
                            lambda st, body: st == 200 and len(json.loads(body)["engines"]) == 1)
        if "--agentic-program-admission" in KVGATE_FLAGS[name]:  # measure once the ledger has its capacity
            procs.wait_http(kv.url + "/kvgate/stats", 30, kv,
                            lambda st, body: st == 200 and not json.loads(body)["ledger"]["degraded"])
        urls[arm] = kv.url
        pgids[arm] = kv.popen.pid
    return urls, pgids


#: An arm run as ``kvgate serve --workers N``: its name ends in -wN.
WORKERS_ARM = re.compile(r"-w(\d+)$")


def workers_ready(metrics_text: str, n: int, ledger: bool) -> bool:
    """From the merged /metrics of ``kvgate serve --workers n``: every worker answered, knows an engine and
    (``ledger``: admission on) has its capacity figures."""
    from prometheus_client.parser import text_string_to_metric_families
    up: dict[str, float] = {}
    engines: dict[str, float] = {}
    degraded: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            w = s.labels.get("worker")
            if s.name == "agentic_kv_worker_up":
                up[w] = s.value
            elif s.name == "agentic_kv_engines" and w is not None:
                engines[w] = engines.get(w, 0) + s.value
            elif s.name == "agentic_kv_budget_degraded" and w is not None:
                degraded[w] = s.value
    workers = [str(i) for i in range(n)]
    return (all(up.get(w) == 1 for w in workers) and all(engines.get(w, 0) >= 1 for w in workers)
            and (not ledger or all(degraded.get(w) == 0 for w in workers)))


def backend_figures(metrics_text: str) -> dict[str, float]:
    """From the merged /metrics of a -wN arm after the run: shared-state calls that fell back (``bypass``:
    Redis unreachable or slower than redis_timeout_s; the requests then went on this worker's own state, so
    the arm's figures would not be those of the shared state), and where the tree counts them, the batched
    Redis ``calls`` and the ``ops`` they carried."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {"bypass": 0.0}
    names = {"agentic_kv_state_backend_bypass_total": "bypass", "agentic_kv_state_backend_calls_total": "calls",
             "agentic_kv_state_backend_ops_total": "ops"}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            key = names.get(s.name)
            if key is not None:
                out[key] = out.get(key, 0.0) + s.value
    return out


def _start_redis(work: Path, started: list[procs.Proc]) -> str:
    """A redis-server on 127.0.0.1:<free port> (no persistence) for the -wN arms; returns its URL."""
    import socket
    exe = procs.find_executable("redis-server") or "/usr/bin/redis-server"
    port = procs.free_port()
    p = procs.start("redis", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                    work)
    started.append(p)
    deadline = time.monotonic() + 30
    while True:  # readiness of a process we started: PING until PONG
        if not p.alive():
            raise RuntimeError(f"redis-server exited:\n{p.log_tail()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return f"redis://127.0.0.1:{port}/0"
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("redis-server did not answer PING in 30 s")
        time.sleep(0.05)


def _wrk(url: str, script: Path, connections: int, seconds: int) -> dict[str, float]:
    import subprocess
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "--timeout", "10s", "-s", str(script),
           url + "/generate"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, start_new_session=True)
    if res.returncode != 0:
        raise RuntimeError(f"wrk failed ({res.returncode}): {res.stderr.strip()[-300:]}")
    return parse_wrk(res.stdout)


def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid``, MiB (/proc/<pid>/status VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _run_waiters(args: argparse.Namespace) -> int:
    """``--waiters N``: N small requests held in admission by a full KV pool, then their clients leave."""
    import asyncio
    import urllib.request
    n = args.waiters
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvgate-proxy-bench-"))
    started: list[procs.Proc] = []

    def stats(url: str) -> dict:
        with urllib.request.urlopen(url + "/kvgate/stats", timeout=30) as r:
            return json.loads(r.read())

    def waiting(url: str) -> int:
        return int(stats(url)["waiting"])

    async def hold(port: int, url: str, pid: int) -> dict[str, float]:
        body = request_body("small")
        req = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
        before = rss_mb(pid)
        writers = []
        for _ in range(n):
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(req)
            writers.append(w)
        deadline = time.monotonic() + 120
        while waiting(url) < n:  # polling a process we started: the one place a short pause is the event
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {waiting(url)} of {n} requests waiting after 120 s")
            await asyncio.sleep(0.2)
        held = rss_mb(pid)
        for w in writers:
            w.close()
        while waiting(url) > 0:
            await asyncio.sleep(0.2)
        # kvgate gives the memory of a large burst back once the handlers have unwound (memory_given_back
        # counts it; a kvgate without it, or a small burst, gets a second)
        from kvgate.admission.gate import GIVE_BACK_AFTER_WAITERS
        t_left = time.monotonic() + 60
        while n >= GIVE_BACK_AFTER_WAITERS and stats(url).get("memory_given_back", 1) < 1 \
                and time.monotonic() < t_left:
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5 if n >= GIVE_BACK_AFTER_WAITERS else 1.0)
        return {"waiters": n, "memory_given_back": stats(url).get("memory_given_back"),
                "rss_before_mib": round(before, 1), "rss_waiting_mib": round(held, 1),
                "rss_after_mib": round(rss_mb(pid), 1), "kib_per_waiter": round((held - before) * 1024 / n, 2)}

    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < n + 100:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 1000), hard))
        nport = procs.free_port()
        conf = work / "nginx.conf"
        conf.write_text(nginx_config(nport, work, token_usage=0.99))
        ng = procs.start("nginx", [procs.find_executable("nginx") or "/usr/sbin/nginx", "-p", str(work), "-c",
                                   str(conf)], work, url=f"http://127.0.0.1:{nport}")
        started.append(ng)
        procs.wait_http(ng.url + "/health", 30, ng)
        kport = procs.free_port()
        kv = procs.start("kvgate", [sys.executable, "-m", "kvgate", "serve", "--upstream", ng.url, "--engines", ng.url,
                                    "--no-compat-probe", "--port", str(kport), "--log-level", "warning",
                                    *KVGATE_FLAGS["lifecycle+admission"], "--agentic-admission-max-wait-s", "3600"],
                         work, url=f"http://127.0.0.1:{kport}")
        started.append(kv)
        procs.wait_http(kv.url + "/kvgate/stats", 30, kv,
                        lambda st, body: st == 200 and not json.loads(body)["ledger"]["degraded"])
        res = asyncio.run(hold(kport, kv.url, kv.popen.pid))
        (out / "proxy-bench-waiters.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res))
        return 0
    finally:
        procs.stop_all(started)
        shutil.rmtree(work, ignore_errors=True)


#: Prompt tokens of each session's request in ``--sessions`` (two 64-token blocks: placement indexes it).
SESSION_PROMPT_TOKENS = 128


def sessions_script(path: Path, n: int) -> None:
    """A wrk Lua script whose k-th request (k <= ``n``) opens session bench-s<k> with a prompt starting with
    token id k (distinct prompts); later requests go back to the first ``n`` sessions."""
    rest = ",".join(str((i * 7919) % 150000 + 1) for i in range(1, SESSION_PROMPT_TOKENS))
    path.write_text(f"""wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
counter = 0
request = function()
  counter = counter + 1
  local k = ((counter - 1) % {n}) + 1
  local body = '{{"input_ids":[' .. k .. ',{rest}],"session_id":"bench-s' .. k .. '",' ..
               '"sampling_params":{{"max_new_tokens":{COMPLETION_TOKENS},"temperature":0}}}}'
  return wrk.format(nil, nil, nil, body)
end
""")


def _run_sessions(args: argparse.Namespace) -> int:
    """``--sessions N``: N sessions opened through real requests; kvgate's RSS before and with them tracked."""
    import subprocess
    import urllib.request
    n = args.sessions
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvgate-proxy-bench-"))
    started: list[procs.Proc] = []

    def tracked(url: str) -> dict:
        with urllib.request.urlopen(url + "/kvgate/sessions?limit=0", timeout=60) as r:
            return json.loads(r.read())

    try:
        nport = procs.free_port()
        conf = work / "nginx.conf"
        conf.write_text(nginx_config(nport, work))
        ng = procs.start("nginx", [procs.find_executable("nginx") or "/usr/sbin/nginx", "-p", str(work), "-c",
                                   str(conf)], work, url=f"http://127.0.0.1:{nport}")
        started.append(ng)
        procs.wait_http(ng.url + "/health", 30, ng)
        kport = procs.free_port()
        cmd = [sys.executable, "-m", "kvgate", "serve", "--upstream", ng.url, "--engines", ng.url,
               "--no-compat-probe", "--port", str(kport), "--log-level", "warning",
               "--agentic-session-lifecycle", "--agentic-program-admission", "--admission-poll-interval-s", "0.5",
               "--session-placement", "kvgate", "--session-idle-close-s", "0", "--max-tracked-sessions", str(n + 10)]
        kv = procs.start("kvgate", cmd, work, url=f"http://127.0.0.1:{kport}")
        started.append(kv)
        procs.wait_http(kv.url + "/kvgate/stats", 30, kv,
                        lambda st, body: st == 200 and not json.loads(body)["ledger"]["degraded"])
        script, warm = work / "sessions.lua", work / "warm.lua"
        sessions_script(script, n)
        wrk_script(warm, request_body("small"), False)
        _wrk(kv.url, warm, 1, 1)  # warm up (one session): first-request costs are not the sessions'
        before = rss_mb(kv.popen.pid)
        base = tracked(kv.url)["tracked"]
        wrk = subprocess.Popen(["wrk", "-t1", "-c32", "-d3600s", "--timeout", "10s", "-s", str(script),
                                kv.url + "/generate"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
        t0 = time.monotonic()
        try:
            while tracked(kv.url)["tracked"] < base + n:  # polling a process we started
                if wrk.poll() is not None or time.monotonic() - t0 > 1800:
                    raise RuntimeError("wrk stopped (or 30 min passed) before every session was opened")
                time.sleep(1.0)
        finally:
            os.killpg(wrk.pid, 15)
            wrk.wait()
        took = time.monotonic() - t0
        time.sleep(1.0)  # the last requests finish
        state = tracked(kv.url)
        held = rss_mb(kv.popen.pid)
        res = {"sessions": state["tracked"] - base, "sessions_before": base, "counts": state["counts"],
               "open_s": round(took, 1), "rss_before_mib": round(before, 1), "rss_sessions_mib": round(held, 1),
               "kib_per_session": round((held - before) * 1024 / max(1, state["tracked"] - base), 2)}
        (out / "proxy-bench-sessions.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res))
        return 0
    finally:
        procs.stop_all(started)
        shutil.rmtree(work, ignore_errors=True)
