"""``kvgate engine start|stop|list``: real SGLang CPU engines (the ones the tests use) by hand (edge).

``start`` runs the launcher (kvgate.tools.sglang_engine) in the foreground: it starts the engines, prints each
one's URL and the model name it serves (what ``/v1/models`` answers: requests must name it), and stays until
Ctrl-C, SIGTERM or SIGHUP, then stops every engine with its whole process group. An engine dies with its
launcher even when the launcher is killed outright (SIGKILL): the engine's server has the kernel's
parent-death signal set, and SGLang sets the same on its scheduler and detokenizer processes. ``--detach``
returns once the engines serve and leaves the launcher in the background. ``stop`` ends launchers started so
(SIGTERM, which stops their engines) and any engine group one left behind; ``list`` shows what runs.

What runs is recorded in ``$KVGATE_ENGINE_RUN_DIR`` (default ``$TMPDIR/kvgate-engines-<uid>``), one
``engine-<port>.json`` per engine, removed when it stops; the engines' logs go there too unless ``--log-dir``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from kvgate.tools import procs, sglang_engine

#: How long ``stop`` waits for a launcher to stop its engines, then for an engine group, seconds.
STOP_WAIT_S = 30.0


def run_dir() -> Path:
    """Where running engines are recorded: ``$KVGATE_ENGINE_RUN_DIR``, else ``$TMPDIR/kvgate-engines-<uid>``."""
    env = os.environ.get("KVGATE_ENGINE_RUN_DIR")
    d = Path(env) if env else Path(tempfile.gettempdir()) / f"kvgate-engines-{os.getuid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``kvgate engine`` subcommands (start, stop, list) on parser ``p``."""
    sub = p.add_subparsers(dest="engine_command", required=True, parser_class=type(p))
    s = sub.add_parser("start", help="start real SGLang CPU engines; print each URL and served model name")
    s.add_argument("--port", type=int, default=0,
                   help="the first engine's port on 127.0.0.1 (the next ones count up from it); 0 = free ports")
    s.add_argument("--count", type=int, default=1, help="how many engines (each ~2.5 GB of memory)")
    s.add_argument("--max-total-tokens", type=int, default=4000,
                   help="each engine's KV pool in tokens (SGLang --max-total-tokens)")
    s.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks per engine (SGLang --dp-size)")
    s.add_argument("--no-session-cache", action="store_true",
                   help="without --enable-session-radix-cache (on by default, with priority eviction)")
    s.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: the run directory)")
    s.add_argument("--timeout-s", type=float, default=900.0,
                   help="how long an engine may take to start (17-32 s idle, minutes on a busy machine)")
    s.add_argument("--detach", action="store_true",
                   help="return once the engines serve; the launcher stays in the background (kvgate engine stop)")
    s.add_argument("--notify-fd", type=int, default=None, help=argparse.SUPPRESS)  # --detach's child
    s.set_defaults(engine_func=cmd_start)
    t = sub.add_parser("stop", help="stop engines started by `kvgate engine start`, with their processes")
    t.add_argument("--port", type=int, nargs="*", default=[], help="only the engines on these ports (default: all)")
    t.set_defaults(engine_func=cmd_stop)
    ls = sub.add_parser("list", help="the engines `kvgate engine start` runs: URL, model, launcher pid")
    ls.set_defaults(engine_func=cmd_list)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvgate engine``. Returns the exit status."""
    return int(args.engine_func(args) or 0)


# --- start ----------------------------------------------------------------------------------------------

def _port_free(port: int) -> str | None:
    """None when 127.0.0.1:port can be bound now, else why not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # as the engine's server binds: connections that closed a moment ago (TIME_WAIT) do not hold the port
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            return os.strerror(exc.errno or errno.EADDRINUSE)
    return None


def served_model(url: str) -> str:
    """The model name the engine at ``url`` serves (GET /v1/models, its first entry's id)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def _record_path(port: int) -> Path:
    return run_dir() / f"engine-{port}.json"


def cmd_start(args: argparse.Namespace) -> int:
    try:
        sglang_engine.engine_python()
    except sglang_engine.EngineUnavailable as exc:
        print(f"kvgate engine: {exc}", file=sys.stderr)
        return 2
    if args.count < 1 or args.dp_size < 1 or args.max_total_tokens < 1:
        print("kvgate engine: --count, --dp-size and --max-total-tokens must be at least 1", file=sys.stderr)
        return 2
    ports = [args.port + i for i in range(args.count)] if args.port else []
    for port in ports:  # before the 20-30 s start, and before anything else is started
        why = _port_free(port)
        if why:
            print(f"kvgate engine: port {port} on 127.0.0.1: {why}", file=sys.stderr)
            return 2
    if args.detach:
        return _start_detached(args)
    procs.exit_on_signals()  # SIGTERM, SIGHUP and SIGINT end this process through its finally: engines stop
    spec = sglang_engine.EngineSpec(max_total_tokens=args.max_total_tokens, session_cache=not args.no_session_cache,
                                    dp_size=args.dp_size)
    log_dir = args.log_dir or run_dir()
    engines: list[sglang_engine.Engine] = []
    status = 0
    try:
        for i in range(args.count):
            port = ports[i] if ports else procs.free_port()
            e = sglang_engine.start_engine(spec, log_dir, f"sglang-{port}", port, args.timeout_s, args.timeout_s,
                                           die_with_launcher=True)
            engines.append(e)
            model = served_model(e.url)
            _record_path(e.port).write_text(json.dumps({
                "url": e.url, "port": e.port, "model": model, "launcher_pid": os.getpid(),
                "engine_pid": e.proc.popen.pid, "max_total_tokens": spec.max_total_tokens,
                "log": str(e.log_path)}))
            print(f"engine {e.url} ready in {e.started_s:.0f} s: served model {model}, KV pool "
                  f"{spec.max_total_tokens} tokens, log {e.log_path}", flush=True)
        print(f"kvgate engine: {len(engines)} engine(s) serving; stop them with Ctrl-C here or `kvgate engine "
              "stop`", flush=True)
        if args.notify_fd is not None:
            os.close(args.notify_fd)  # --detach's parent reads EOF: every engine serves
        status = _wait_any(engines)
    except KeyboardInterrupt:
        status = 130
    except SystemExit as exc:  # SIGTERM or SIGHUP (exit_on_signals)
        status = int(exc.code or 0)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"kvgate engine: {exc}", file=sys.stderr)
        status = 1
    finally:
        procs.stop_all([e.proc for e in engines], grace_s=10.0)
        for e in engines:
            e.stop()  # gives the machine-wide engine slot back
            _record_path(e.port).unlink(missing_ok=True)
    if engines:
        print(f"kvgate engine: stopped {len(engines)} engine(s)", file=sys.stderr)
    return status


def _wait_any(engines: list[sglang_engine.Engine]) -> int:
    """Block until one engine's server exits (without reaping it); say which. Returns 1."""
    info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
    gone = next((e for e in engines if info is not None and e.proc.popen.pid == info.si_pid), None)
    name = gone.url if gone is not None else f"pid {info.si_pid if info else '?'}"
    print(f"kvgate engine: the engine {name} exited (status {info.si_status if info else '?'}); stopping the rest",
          file=sys.stderr)
    return 1


def _start_detached(args: argparse.Namespace) -> int:
    """Run ``kvgate engine start`` (without --detach) in a session of its own and return once its engines serve
    (it closes the pipe it was given) or it exits (then its log's tail, and 1)."""
    log_dir = args.log_dir or run_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"launcher-{os.getpid()}.log"
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "kvgate", "engine", "start", "--port", str(args.port), "--count", str(args.count),
           "--max-total-tokens", str(args.max_total_tokens), "--dp-size", str(args.dp_size),
           "--timeout-s", str(args.timeout_s), "--log-dir", str(log_dir), "--notify-fd", str(w)]
    if args.no_session_cache:
        cmd.append("--no-session-cache")
    with open(log_path, "wb") as fh:
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                 start_new_session=True, pass_fds=(w,))
    os.close(w)
    try:
        with os.fdopen(r, "rb") as pipe:
            pipe.read()  # EOF: the launcher's engines serve, or it exited
    except KeyboardInterrupt:
        child.terminate()  # the launcher stops what it started
        child.wait()
        return 130
    if child.poll() is not None:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        print(f"kvgate engine: the launcher exited with {child.returncode}:\n{tail}", file=sys.stderr)
        return 1
    for rec in _records():
        if rec.get("launcher_pid") == child.pid:
            print(f"engine {rec['url']} ready: served model {rec['model']}, KV pool {rec['max_total_tokens']} "
                  f"tokens, log {rec['log']}")
    print(f"kvgate engine: launcher pid {child.pid} in the background (log {log_path}); stop with "
          "`kvgate engine stop`")
    return 0


# --- stop and list ------------------------------------------------------------------------------------------

def _records() -> list[dict]:
    out = []
    for path in sorted(run_dir().glob("engine-*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rec["_path"] = str(path)
        out.append(rec)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int, marker: str) -> bool:
    """Whether ``pid`` runs and is still what was recorded (its command line holds ``marker``: a pid the kernel
    gave to another program since is not ours to signal)."""
    return bool(pid) and marker in _cmdline(pid)


def _wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait until process ``pid`` (not our child) exits, on its pidfd. True when it did within ``timeout_s``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(fd)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies aside: an orphan's zombie, where nothing reaps
    it, holds no port and no memory)."""
    if not pgid:
        return False
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_record(rec: dict) -> str:
    """Stop one recorded engine: its launcher (SIGTERM: it stops its engines), then whatever is left of the
    engine's process group (SIGTERM, then SIGKILL). Returns what was done, in a few words."""
    launcher, engine = int(rec.get("launcher_pid") or 0), int(rec.get("engine_pid") or 0)
    done = "already gone"
    if _alive(launcher, "kvgate"):
        os.kill(launcher, signal.SIGTERM)
        _wait_gone(launcher, STOP_WAIT_S)
        done = f"stopped by its launcher (pid {launcher})"
    if _group_alive(engine) and (not _cmdline(engine) or "sglang" in _cmdline(engine)):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(engine, sig)
            except ProcessLookupError:
                break
            _wait_gone(engine, STOP_WAIT_S / 3)
            if not _group_alive(engine):
                break
        done = "stopped (its process group)"
    Path(rec["_path"]).unlink(missing_ok=True)
    return done


def cmd_stop(args: argparse.Namespace) -> int:
    recs = [r for r in _records() if not args.port or r.get("port") in args.port]
    if not recs:
        print("kvgate engine: no engine started by `kvgate engine start` runs" +
              (f" on port {' '.join(map(str, args.port))}" if args.port else ""))
        return 0
    for rec in recs:
        print(f"engine {rec.get('url')}: {stop_record(rec)}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    recs = _records()
    for rec in recs:
        state = "running" if _group_alive(int(rec.get("engine_pid") or 0)) else "gone (kvgate engine stop clears it)"
        print(f"engine {rec.get('url')}: served model {rec.get('model')}, KV pool {rec.get('max_total_tokens')} "
              f"tokens, launcher pid {rec.get('launcher_pid')}, {state}")
    if not recs:
        print("kvgate engine: none running")
    return 0
