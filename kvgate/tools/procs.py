"""Subprocesses kvgate starts (router, simulated engines, kvgate itself) for the demo, bench and tests.

Each child gets its own process group (the smg launcher forks a child ``smg::router``) and is ended
by signalling the whole group: SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


# Signals that end an orchestrating process (demo, bench) while it owns child process groups: SIGTERM (kill,
# systemd), SIGHUP (the terminal or ssh session closed). Children run in their own sessions, so none of these
# reach them by themselves.
TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def exit_on_signals() -> None:
    """Make the first SIGTERM, SIGHUP or SIGINT end this (orchestrating) process cleanly: SIGTERM and SIGHUP
    raise SystemExit(128 + signum), SIGINT raises KeyboardInterrupt, so its ``finally`` blocks run and every
    child process group it started is stopped instead of being orphaned. Every later one of these signals is
    ignored: the process is already stopping, and a second Ctrl-C must not interrupt that (or the exit after it).

    A SIGINT ignored when the process started (a background job of a non-interactive shell) stays ignored,
    as POSIX shells intend; such a process is stopped with SIGTERM."""
    def _raise(signum, frame):
        for sig in (signal.SIGINT, *TERMINATING_SIGNALS):
            if signal.getsignal(sig) is _raise:
                signal.signal(sig, signal.SIG_IGN)
        exc = KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise exc from None
        if asyncio.current_task(loop) is None:
            raise exc  # in the event loop itself: out of asyncio.run, which then cancels every task
        # Inside a task's step: raised there, the exception would end that task alone and asyncio would print
        # "Task exception was never retrieved" with a traceback; raise it from the loop's next callback instead.

        def _stop():
            raise exc
        loop.call_soon_threadsafe(_stop)
    for sig in TERMINATING_SIGNALS:
        signal.signal(sig, _raise)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _raise)


def stop_all(started: list["Proc"], grace_s: float = 5.0) -> None:
    """Stop every process group in ``started`` (newest first) without being interrupted half way: SIGINT,
    SIGTERM and SIGHUP are held back until every group is gone (a second Ctrl-C while waiting for one child
    used to leave the rest running), and every group gets its SIGTERM before the first wait."""
    held = {signal.SIGINT, *TERMINATING_SIGNALS}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        for p in reversed(started):
            p.terminate()
        for p in reversed(started):
            p.stop(grace_s)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


#: Ports free_port() handed out lately (newest last): the kernel may offer a port again before the process it
#: was meant for has bound it (seen on a busy machine: two engines of one fleet given one port).
_HANDED_OUT: collections.deque = collections.deque(maxlen=4096)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to 0, read, close), never one this process
    handed out among its last 4,096."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.append(port)
            return port


def find_executable(name: str) -> str | None:
    """``name`` on PATH, else next to the running interpreter (a venv's bin/ need not be on PATH)."""
    found = shutil.which(name)
    if found:
        return found
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else None


@dataclass
class Proc:
    """A started child process in its own group; ``log_path`` holds its stdout and stderr."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    url: str | None = None
    _log_fh: object = field(default=None, repr=False)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 40, width: int = 400) -> str:
        """The last ``n`` lines of the log, each cut to ``width`` characters (SGLang logs its whole
        server_args, 20 KB, on one line)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return ""
        return "\n".join(ln if len(ln) <= width else ln[:width] + " ..." for ln in lines)

    def terminate(self) -> None:
        """SIGTERM the whole process group (no wait)."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float = 5.0) -> int | None:
        """End the whole process group: SIGTERM, then SIGKILL after ``grace_s`` seconds."""
        if self.popen.poll() is None:
            self.terminate()
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # children of the group (smg::router) may outlive the leader
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        if self._log_fh is not None:
            self._log_fh.close()
        return self.popen.returncode


def group_cpu_seconds(pgids) -> dict[int, float]:
    """CPU time (user + system, seconds) used so far by the live processes of each process group in ``pgids``,
    and by the descendants of each group's leader that run in groups of their own (``kvgate serve --workers N``
    starts its workers so), read from /proc/PID/stat (fields ppid, pgrp, utime, stime); a process counts for
    the first of the groups it or an ancestor belongs to, and a group with no live process gives 0. Processes
    that already exited are not counted (their parent may not have waited for them). {} where there is no
    /proc."""
    want = {int(g): 0 for g in pgids}
    try:
        entries = [e for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return {}
    procs_: dict[int, tuple[int, int, int]] = {}  # pid -> (ppid, pgrp, cpu ticks)
    for entry in entries:
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: the fields start after the last ')'
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp ...
        procs_[int(entry.name)] = (int(fields[1]), int(fields[2]), int(fields[11]) + int(fields[12]))

    def group_of(pid: int) -> int | None:
        for _ in range(64):  # up the parent chain to a wanted group's leader (or init)
            info = procs_.get(pid)
            if info is None:
                return None
            if info[1] in want:
                return info[1]
            if pid in want:
                return pid
            pid = info[0]
        return None

    for pid, (_, _, ticks) in procs_.items():
        g = group_of(pid)
        if g is not None:
            want[g] += ticks
    tick = os.sysconf("SC_CLK_TCK")
    return {g: t / tick for g, t in want.items()}


def start(name: str, cmd: list[str], log_dir: Path, env: dict | None = None, url: str | None = None,
          cwd: Path | None = None, die_with_parent: bool = False) -> Proc:
    """Start ``cmd`` in a new session (process group), in ``cwd`` (default: ours); output goes to
    log_dir/name.log.

    die_with_parent: the child gets SIGKILL when this thread ends, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing). Only for a child started from a thread that lives as long as the
    process (the main thread): the signal follows the starting thread, not the process."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    fh = open(log_path, "wb")
    popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env={**os.environ, **(env or {})}, cwd=cwd,
                             preexec_fn=_die_with_parent(os.getpid()) if die_with_parent else None)
    return Proc(name, popen, log_path, url, fh)


def _die_with_parent(parent_pid: int):
    """A preexec_fn: ask the kernel for SIGKILL when the parent thread ends; exit at once when the parent is
    already gone (it died between fork and here). Nothing where prctl is not there (not Linux)."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    PR_SET_PDEATHSIG = 1  # linux/prctl.h

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:
            os._exit(1)
    return preexec


def wait_http(url: str, timeout_s: float, proc: Proc | None = None, expect=lambda status, body: status == 200) -> bytes:
    """Poll GET ``url`` until ``expect(status, body)`` holds; return the body.

    Raises RuntimeError with the process's log tail if ``proc`` exits, or TimeoutError after ``timeout_s``.
    A readiness poll of a process we started is the one place a loop with a short pause is the event.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                body = resp.read()
                if expect(resp.status, body):
                    return body
                last = f"{resp.status} {body[:200]!r}"
        except urllib.error.HTTPError as exc:
            body = exc.read()
            if expect(exc.code, body):
                return body
            last = f"{exc.code} {body[:200]!r}"
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            last = str(exc)
        time.sleep(0.05)
    tail = f"\n{proc.log_tail()}" if proc is not None else ""
    raise TimeoutError(f"{url} not ready after {timeout_s}s (last: {last}){tail}")


def smg_installed() -> bool:
    """Whether the smg router package is importable by this interpreter (what :func:`smg_command` runs)."""
    return importlib.util.find_spec("smg") is not None


def smg_command(port: int, worker_urls: list[str], prometheus_port: int, policy: str = "round_robin",
                extra: list[str] | None = None) -> list[str]:
    """The command line that starts the smg router on 127.0.0.1 (docs/compatibility.md#starting-the-router). Raises
    FileNotFoundError when smg is not installed. It runs the smg package itself (``python -m smg``), not the
    ``smg`` script on PATH: sglang-router 0.3.2 installs a script of that name too, and where it was installed
    after smg the script starts the old router."""
    if not smg_installed():
        raise FileNotFoundError("the smg router is not installed (pip install smg)")
    return [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(prometheus_port),
            # on SIGTERM smg 1.13 first waits out a grace period for requests in flight (180 s by default; a stop
            # with nothing in flight took the 5 s until SIGKILL)
            "--shutdown-grace-period-secs", "0", *(extra or [])]


def smg_pd_command(port: int, prefill: list[tuple[str, "int | None"]], decode: list[str], prometheus_port: int,
                   policy: str = "round_robin", extra: list[str] | None = None) -> list[str]:
    """The command line that starts smg 1.13 in prefill/decode mode on 127.0.0.1: ``prefill`` is (URL, bootstrap
    port or None) per prefill worker, ``decode`` the decode workers' URLs (docs/compatibility.md). Raises
    FileNotFoundError when smg is not installed."""
    if not smg_installed():
        raise FileNotFoundError("the smg router is not installed (pip install smg)")
    legs: list[str] = ["--pd-disaggregation"]
    for url, bport in prefill:
        legs += ["--prefill", url, "none" if bport is None else str(bport)]
    for url in decode:
        legs += ["--decode", url]
    return [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port), *legs,
            "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            "--shutdown-grace-period-secs", "0", *(extra or [])]


def legacy_router_command(port: int, worker_urls: list[str], prometheus_port: int,
                          policy: str = "round_robin") -> list[str]:
    """sglang-router 0.3.2 (python -m sglang_router.launch_router, same flags as smg)."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(prometheus_port)]


def router_ready(healthy_workers: int):
    """A ``wait_http`` predicate for GET /readiness: ready with at least ``healthy_workers`` workers."""
    import json

    def ok(status: int, body: bytes) -> bool:
        if status != 200:
            return False
        try:
            return int(json.loads(body).get("healthy_workers", 0)) >= healthy_workers
        except (ValueError, AttributeError, TypeError):
            return True
    return ok


def redis_command(port: int) -> list[str]:
    """A throwaway redis-server on 127.0.0.1:``port``: no snapshots, no append-only file (state lives only as
    long as the process). Raises FileNotFoundError when redis-server (Debian package redis-server) is missing."""
    exe = find_executable("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server")
                                              else None)
    if exe is None:
        raise FileNotFoundError("redis-server is not installed (Debian package redis-server)")
    return [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]


def wait_redis(port: int, timeout_s: float, proc: Proc | None = None) -> None:
    """Wait until the redis-server on 127.0.0.1:``port`` answers PING (plain RESP over a socket). Raises
    RuntimeError with the log tail if ``proc`` exits, TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
                if reply.startswith(b"+PONG"):
                    return
                last = repr(reply[:64])
        except OSError as exc:
            last = str(exc)
        time.sleep(0.05)  # readiness of a process we started (see wait_http)
    tail = f"\n{proc.log_tail()}" if proc is not None else ""
    raise TimeoutError(f"redis-server on port {port} not ready after {timeout_s}s (last: {last}){tail}")
