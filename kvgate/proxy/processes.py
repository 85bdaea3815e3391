"""Several kvgate processes on one port (``workers: N``): the supervisor and each process's view of its
siblings (I/O edge; the /metrics merge rule is kvgate.proxy.process_metrics).

``kvgate serve`` with ``workers: N > 1`` becomes the supervisor. It binds ``host:port`` once with
SO_REUSEPORT (port 0 is resolved here, and the bound socket keeps the port for restarts; it never
listens, so the kernel gives it no connections), writes the validated configuration into a private run
directory and starts N processes, each ``python -m kvgate serve --config <run dir>/config.yaml`` in its own
process group, with ``KVGATE_PROCESS_DIR`` and ``KVGATE_PROCESS_INDEX`` set. A process is a full kvgate: it
binds the same ``host:port`` with SO_REUSEPORT (the kernel spreads new connections over the processes by
a hash of the connection's addresses) and also listens on a private ``127.0.0.1`` port, which it writes to
``<run dir>/process-<i>.json`` once it serves. A process answering GET /metrics on the shared port fetches
its siblings' own figures from their private ports (GET /kvgate/worker/metrics) and answers the merge.

What the processes must agree on (sessions, idle close, placement, inferred sessions, admission leases)
is in Redis (``state_backend: redis``, kvgate.shared.redis_state), exactly as for replicas on several
machines; ``workers > 1`` with ``state_backend: memory`` is a config error.

The supervisor restarts a process that exits (logged, counted in ``<run dir>/supervisor.json``, shown as
``agentic_kv_worker_restarts_total``), waiting longer after each exit that comes soon after a start, and
stops every process by process group on SIGINT, SIGTERM or SIGHUP (SIGTERM, then SIGKILL after a grace
period). A process whose supervisor is gone (its stdin, a pipe from the supervisor, reaches EOF) stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvgate.config import Config
from kvgate.tools import procs

log = logging.getLogger("kvgate.processes")

ENV_DIR = "KVGATE_PROCESS_DIR"
ENV_INDEX = "KVGATE_PROCESS_INDEX"
#: A process has this long to serve after its start; one that does not is stopped and counted as exited.
START_TIMEOUT_S = 60.0
#: An exit this soon after a start doubles the wait before the next start (up to RESTART_MAX_DELAY_S).
RESTART_SOON_S = 10.0
RESTART_MAX_DELAY_S = 10.0
#: One sibling's answer to a /metrics or /kvgate/health fan-in, seconds.
PEER_TIMEOUT_S = 2.0


# --- the run directory both sides read ------------------------------------------------------------

def registration_path(run_dir: Path, index: int) -> Path:
    return run_dir / f"process-{index}.json"


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write ``obj`` as JSON to ``path`` so a reader never sees half a file (temp file + rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- the process's side ------------------------------------------------------------------------------

@dataclass
class ProcessRole:
    """This process is number ``index`` of ``count`` started by a supervisor that shares ``run_dir``.

    ``private_port`` is set once the private 127.0.0.1 site listens (:meth:`register` publishes it)."""

    index: int
    count: int
    run_dir: Path
    private_port: int = 0
    _http: object = field(default=None, repr=False)

    @classmethod
    def from_env(cls, cfg: Config) -> "ProcessRole | None":
        """The role the supervisor gave this process through the environment, or None (not one of several)."""
        run_dir = os.environ.get(ENV_DIR)
        if not run_dir:
            return None
        return cls(int(os.environ.get(ENV_INDEX, "0")), cfg.workers, Path(run_dir))

    def register(self, private_port: int) -> None:
        """Publish this process's private port: siblings find it there from now on."""
        self.private_port = private_port
        write_json_atomic(registration_path(self.run_dir, self.index),
                          {"index": self.index, "pid": os.getpid(), "port": private_port})

    def unregister(self) -> None:
        path = registration_path(self.run_dir, self.index)
        if (read_json(path) or {}).get("pid") == os.getpid():
            try:
                path.unlink()
            except OSError:
                pass

    def siblings(self) -> dict[int, int | None]:
        """Every process slot but this one -> its private port, or None when it is not registered (down)."""
        out: dict[int, int | None] = {}
        for i in range(self.count):
            if i != self.index:
                reg = read_json(registration_path(self.run_dir, i))
                out[i] = int(reg["port"]) if reg and "port" in reg else None
        return out

    def restarts(self) -> dict[str, int]:
        """Slot index -> times the supervisor restarted that slot (its supervisor.json)."""
        sup = read_json(self.run_dir / "supervisor.json") or {}
        return {str(k): int(v) for k, v in (sup.get("restarts") or {}).items()}

    async def start(self) -> None:
        import aiohttp
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PEER_TIMEOUT_S))

    async def stop(self) -> None:
        self.unregister()
        if self._http is not None:
            await self._http.close()

    async def _get(self, port: int | None, path: str) -> bytes | None:
        if port is None or self._http is None:
            return None
        try:
            async with self._http.get(f"http://127.0.0.1:{port}{path}") as resp:
                return await resp.read() if resp.status == 200 else None
        except Exception:  # a sibling that is restarting or stuck counts as down for this scrape
            return None

    async def merged_metrics(self, own: bytes) -> bytes:
        """This process's exposition ``own`` merged with every sibling's (kvgate.proxy.process_metrics)."""
        from kvgate.proxy.process_metrics import merge_expositions
        sib = self.siblings()
        bodies = await asyncio.gather(*(self._get(port, "/kvgate/worker/metrics") for port in sib.values()))
        texts = {self.index: own, **dict(zip(sib, bodies))}
        parts = [(str(i), None if texts.get(i) is None else texts[i].decode("utf-8", "replace"))
                 for i in range(self.count)]
        return await asyncio.to_thread(merge_expositions, parts, self.count, self.restarts())

    async def health(self) -> dict:
        """How many processes are up (answering their private /kvgate/worker/health now), which one answered
        and how many times the supervisor restarted one."""
        sib = self.siblings()
        bodies = await asyncio.gather(*(self._get(port, "/kvgate/worker/health") for port in sib.values()))
        return {"configured": self.count, "up": 1 + sum(b is not None for b in bodies), "this_worker": self.index,
                "restarts": sum(self.restarts().values())}


async def watch_supervisor(stop: asyncio.Event) -> None:
    """Set ``stop`` when stdin (the supervisor's pipe) reaches EOF: the supervisor is gone, so is this process."""
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    gone = asyncio.Event()

    def readable() -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            gone.set()
    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)
    await gone.wait()
    log.warning("the supervisor is gone; this process stops")
    stop.set()


# --- the supervisor's side ----------------------------------------------------------------------------

class StartupError(RuntimeError):
    """The supervisor could not prepare its processes; ``str(err)`` is the one line to print."""


class BindError(OSError):
    """bind() refused the address (errno EADDRINUSE, EACCES, EADDRNOTAVAIL ...): the one failure that is
    said as ``cannot listen on``."""


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind ``host:port`` with SO_REUSEPORT without listening: port 0 becomes a fixed free port the processes
    then bind, an address in use fails here, before any process starts. Raises BindError when bind() fails,
    another OSError (socket.gaierror, EMFILE ...) when a step before it does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if infos:
        family = infos[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BindError(exc.errno, exc.strerror) from None
    return sock


def restart_delay(previous_s: float, lived_s: float) -> float:
    """Seconds to wait before restarting a process that lived ``lived_s`` after its last start, given the
    wait before that start: none after a long life, else double (a crash loop is slowed down, not fed)."""
    if lived_s >= RESTART_SOON_S:
        return 0.0
    return min(RESTART_MAX_DELAY_S, max(0.25, previous_s * 2))


@dataclass
class _Slot:
    index: int
    proc: procs.Proc | None = None
    started: float = 0.0
    restarts: int = 0
    delay_s: float = 0.0
    due: float = 0.0  # when a dead process is started again (monotonic seconds)


class Supervisor:
    """Starts, restarts and stops the ``cfg.workers`` kvgate processes of one ``kvgate serve``."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.count = cfg.workers
        self.run_dir: Path | None = None  # made by prepare
        self.slots = [_Slot(i) for i in range(self.count)]
        self.stopping = False
        self._sock: socket.socket | None = None
        self.port = cfg.port

    def prepare(self) -> None:
        """Reserve the port, make the run directory and write the processes' configuration there. Raises
        StartupError whose text is the one line to print: ``cannot listen on`` only when bind() failed
        (kvgate.proxy.bootstrap.listen_error); any other step says what it could not do, and why."""
        from kvgate.proxy.bootstrap import listen_error
        host = self.cfg.host
        try:
            self._sock = reserve_port(host, self.cfg.port)
        except BindError as exc:
            raise StartupError(listen_error(host, self.cfg.port, exc.errno)) from None
        except socket.gaierror as exc:  # the host resolved when the config was checked, and no longer does
            raise StartupError(f"kvgate: startup error: cannot resolve host {host!r} ({exc.strerror or exc})") \
                from None
        except OSError as exc:  # before bind(): no socket to be had (EMFILE, ENOBUFS ...)
            raise StartupError(f"kvgate: startup error: cannot open a socket for {host}:{self.cfg.port} "
                               f"({exc.strerror or exc})") from None
        self.port = self._sock.getsockname()[1]
        try:
            self.run_dir = Path(tempfile.mkdtemp(prefix="kvgate-processes-"))
            values = dict(self.cfg.as_dict(), port=self.port)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
            self._write_status()
        except Exception as exc:  # ENOSPC, EROFS, a full inode table ...: the step said, never a listen error
            step = (f"create the worker processes' run directory in {tempfile.gettempdir()}" if self.run_dir is None
                    else f"write the worker processes' configuration to {self.run_dir}")
            self.stop()
            what = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
            raise StartupError(f"kvgate: startup error: cannot {step} ({' '.join(str(what).split())})") from None

    def _write_status(self) -> None:
        write_json_atomic(self.run_dir / "supervisor.json",
                          {"pid": os.getpid(), "processes": self.count, "port": self.port,
                           "restarts": {str(s.index): s.restarts for s in self.slots}})

    def start_process(self, slot: _Slot) -> None:
        registration_path(self.run_dir, slot.index).unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "kvgate", "serve", "--config", str(self.run_dir / "config.yaml")]
        env = {**os.environ, ENV_DIR: str(self.run_dir), ENV_INDEX: str(slot.index)}
        # stdin: a pipe the supervisor never writes to; its EOF tells the process the supervisor is gone.
        # stdout/stderr: the supervisor's own (one log stream). Own session: stopped by process group.
        popen = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env, start_new_session=True)
        slot.proc = procs.Proc(f"process{slot.index}", popen, Path(os.devnull))
        slot.started = time.monotonic()

    def registered(self, slot: _Slot) -> bool:
        reg = read_json(registration_path(self.run_dir, slot.index))
        return bool(reg) and slot.proc is not None and reg.get("pid") == slot.proc.popen.pid

    def wait_ready(self, wake_r: int) -> bool:
        """Wait until every process serves. False when one exits first or START_TIMEOUT_S passes, or on a
        stop signal."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.stopping:
            if all(self.registered(s) for s in self.slots):
                return True
            for s in self.slots:
                if s.proc is not None and not s.proc.alive():
                    log.error("process %d exited with status %s before serving", s.index, s.proc.popen.returncode)
                    return False
            if time.monotonic() > deadline:
                log.error("processes not serving after %.0f s", START_TIMEOUT_S)
                return False
            # Readiness of processes we started: a short wait, cut short by any signal (SIGCHLD included).
            _wait(wake_r, 0.05)
        return False

    def reap(self) -> None:
        """Restart the processes that exited (after their delay)."""
        now = time.monotonic()
        for s in self.slots:
            if s.proc is not None and not s.proc.alive():
                code = s.proc.popen.returncode
                lived = now - s.started
                s.proc.stop(1.0)  # whatever else is left in its process group
                if s.proc.popen.stdin is not None:
                    s.proc.popen.stdin.close()
                s.proc = None
                registration_path(self.run_dir, s.index).unlink(missing_ok=True)
                s.delay_s = restart_delay(s.delay_s, lived)
                s.due = now + s.delay_s
                log.warning("process %d exited with status %s after %.1f s; restarting it%s", s.index, code, lived,
                            f" in {s.delay_s:.2f} s" if s.delay_s else "")
            if s.proc is None and now >= s.due and not self.stopping:
                s.restarts += 1
                self._write_status()
                self.start_process(s)
                log.info("process %d restarted (pid %d, restart %d)", s.index, s.proc.popen.pid, s.restarts)

    def next_wake(self) -> float:
        now = time.monotonic()
        due = [s.due - now for s in self.slots if s.proc is None]
        return max(0.0, min(due)) if due else 1.0

    def stop(self) -> None:
        self.stopping = True
        procs.stop_all([s.proc for s in self.slots if s.proc is not None])
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def _wait(fd: int, timeout_s: float) -> None:
    """Sleep up to ``timeout_s`` or until a signal arrives (the wakeup fd becomes readable); drain it."""
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
    except InterruptedError:
        return
    if ready:
        try:
            while os.read(fd, 512):
                pass
        except BlockingIOError:
            pass


def supervise(cfg: Config) -> int:
    """Run ``cfg.workers`` kvgate processes on cfg.host:cfg.port until SIGINT, SIGTERM or SIGHUP.
    Returns the exit status: 0 after a stop signal, 1 when the processes did not come up, 2 when preparing
    them failed (one line: the port cannot be bound, or what else failed; Supervisor.prepare)."""
    sup = Supervisor(cfg)
    try:
        sup.prepare()
    except StartupError as exc:
        sup.stop()
        print(exc, file=sys.stderr)
        return 2
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)

    def on_stop(signum, frame) -> None:
        sup.stopping = True
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_stop)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # only to wake the loop through the wakeup fd
    status = 0
    try:
        for s in sup.slots:
            sup.start_process(s)
        if not sup.wait_ready(wake_r):
            status = 0 if sup.stopping else 1
        else:
            log.info("kvgate listening on http://%s:%d with %d kvgate processes (pids %s)", cfg.host, sup.port,
                     sup.count, ", ".join(str(s.proc.popen.pid) for s in sup.slots if s.proc))
            while not sup.stopping:
                sup.reap()
                _wait(wake_r, sup.next_wake())
        log.info("stopping %d kvgate processes", sup.count)
    finally:
        sup.stop()
        signal.set_wakeup_fd(-1)
        os.close(wake_r)
        os.close(wake_w)
    return status


__all__ = ["BindError", "ENV_DIR", "ENV_INDEX", "StartupError", "Supervisor", "ProcessRole", "reserve_port", "restart_delay", "supervise",
           "watch_supervisor"]
