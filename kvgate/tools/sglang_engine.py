"""The one launcher of real SGLang engines (CPU) for kvgate's tests, ``kvgate bench`` and ``kvgate demo``.

An engine is SGLang 0.5.23's own server (HTTP server, tokenizer manager, scheduler, radix cache, metrics) from a
virtual environment of its own (``scripts/setup-engine.sh``; its pins are not kvgate's), serving a tiny Llama
with random weights (``--load-format dummy``) on the CPU. What it takes and why each flag is there:
docs/real-engines.md. By hand: ``kvgate engine start`` (kvgate.tools.engine_command).

Each engine runs in its own process group, logs to a file, sleeps when idle (``--sleep-on-idle``: an idle
scheduler otherwise spins a core) and computes on one thread (``OMP_NUM_THREADS=1``). A machine-wide slot
(an ``flock`` on one of ``KVGATE_ENGINE_SLOTS`` files, 3 by default) is held while an engine runs, so tests,
benches and demos started side by side never run more engines than the machine holds (~2.5 GB each).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.tools import procs

SGLANG_VERSION = "0.5.23"
_HERE = Path(__file__).resolve().parent
STANDIN_DIR = _HERE / "sglang_cpu"          # holds the sgl_kernel stand-in package
MAKE_MODEL = STANDIN_DIR / "make_model.py"
REPO_ROOT = _HERE.parents[1]


class EngineUnavailable(RuntimeError):
    """No real engine can run here: the engine's virtual environment is missing or broken (the message says
    which and how to install it)."""


def engine_venv() -> Path:
    """The engine's virtual environment: ``$KVGATE_ENGINE_VENV``, else ``.venv-engine`` at the repository root
    (where ``scripts/setup-engine.sh`` puts it)."""
    env = os.environ.get("KVGATE_ENGINE_VENV")
    return Path(env) if env else REPO_ROOT / ".venv-engine"


def engine_python() -> Path:
    """The engine venv's interpreter. Raises EngineUnavailable when it is not installed."""
    py = engine_venv() / "bin" / "python"
    if not py.exists():
        raise EngineUnavailable(f"no SGLang engine environment at {engine_venv()} (run scripts/setup-engine.sh, "
                                "or set KVGATE_ENGINE_VENV)")
    return py


def unavailable_reason() -> str | None:
    """None when a real engine can start here, else why not (for a test's skip message)."""
    if os.environ.get("KVGATE_SKIP_ENGINE"):
        return "KVGATE_SKIP_ENGINE is set"
    try:
        py = engine_python()
    except EngineUnavailable as exc:
        return str(exc)
    if not (engine_venv() / ".installed").exists():
        return f"{engine_venv()} is not a finished install (run scripts/setup-engine.sh again)"
    return None if py.exists() else "engine interpreter missing"


def model_dir(profile: str = "tiny", root: Path | None = None) -> Path:
    """Build (once) and return the model directory for ``profile`` (``tiny`` or ``mlp``; make_model.py says
    what each is). ``root`` defaults to ``$KVGATE_ENGINE_HOME`` or ``.engine/`` at the repository root.
    Raises EngineUnavailable without an engine environment, RuntimeError when the build fails."""
    base = root or Path(os.environ.get("KVGATE_ENGINE_HOME") or REPO_ROOT / ".engine")
    out = base / f"model-{profile}"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    done = subprocess.run([str(engine_python()), str(MAKE_MODEL), str(out), "--profile", profile],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"building the {profile} model directory failed:\n{done.stderr[-2000:]}")
    return out


@dataclass
class EngineSpec:
    """How to start one engine. Token counts are KV slots (tokens).

    max_total_tokens: the KV pool (SGLang ``--max-total-tokens``; the engine reports it as max_total_num_tokens).
    session_cache: ``--enable-session-radix-cache`` with ``--radix-eviction-policy priority`` (SGLang >= 0.5.17:
    an open session's KV is kept under pressure, a closed one's goes first).
    profile: the model (``tiny`` for tests, ``mlp`` for benches). extra: further SGLang flags.
    cache_report: ``--enable-cache-report``: the OpenAI routes report ``usage.prompt_tokens_details.cached_tokens``
    (without it SGLang 0.5.23 sends ``prompt_tokens_details: null``, and a client or kvgate sees no cache hits on
    chat and completions; /generate's meta_info.cached_tokens is always there). env: further environment
    variables for the server. dp_size: ``--dp-size`` (each rank a KV pool of max_total_tokens); on the CPU
    SGLang 0.5.23 binds each rank to a NUMA node and refuses more ranks than nodes (utils/numa_utils.py
    init_threads_binding) unless ``SGLANG_CPU_OMP_THREADS_BIND`` names each rank's cores, so the launcher gives
    rank i core i (modulo the machine's cores) when ``env`` does not say.
    """

    max_total_tokens: int = 4000
    session_cache: bool = True
    profile: str = "tiny"
    served_model_name: str = "kvgate-tiny"
    chunked_prefill_size: int | None = None
    max_running_requests: int | None = None
    extra: list[str] = field(default_factory=list)
    cache_report: bool = True
    env: dict[str, str] = field(default_factory=dict)
    dp_size: int = 1


def sglang_command(spec: EngineSpec, port: int, model: Path) -> tuple[list[str], dict[str, str]]:
    """The command line and environment additions that start SGLang's server for ``spec`` on 127.0.0.1:port."""
    cmd = [str(engine_python()), "-m", "sglang.launch_server", "--model-path", str(model),
           "--served-model-name", spec.served_model_name, "--load-format", "dummy",
           "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
           "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", str(spec.max_total_tokens),
           "--enable-metrics", "--sleep-on-idle", "--tp-size", "1", "--random-seed", "0"]
    if spec.session_cache:
        cmd += ["--enable-session-radix-cache", "--radix-eviction-policy", "priority"]
    if spec.cache_report:
        cmd += ["--enable-cache-report"]
    if spec.dp_size > 1:
        cmd += ["--dp-size", str(spec.dp_size)]
    if spec.chunked_prefill_size:
        cmd += ["--chunked-prefill-size", str(spec.chunked_prefill_size)]
    if spec.max_running_requests:
        cmd += ["--max-running-requests", str(spec.max_running_requests)]
    cmd += spec.extra
    env = {
        "SGLANG_USE_CPU_ENGINE": "1",  # sglang/srt/utils: is_cpu() reads it; selects the CPU platform
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(STANDIN_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",  # no hub here: the model directory is local
        "SGLANG_DISABLE_REQUEST_LOGGING": "1",
    }
    if spec.dp_size > 1:
        cores = os.cpu_count() or 1
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % cores) for i in range(spec.dp_size))
    env.update(spec.env)
    return cmd, env


def _slot_dir() -> Path:
    d = Path(os.environ.get("KVGATE_ENGINE_SLOT_DIR") or "/tmp/kvgate-engine-slots")
    d.mkdir(parents=True, exist_ok=True)
    return d


def acquire_slot(timeout_s: float = 600.0) -> int:
    """Take one of the machine's ``KVGATE_ENGINE_SLOTS`` (default 3) engine slots: an exclusive ``flock`` on a
    file, held by the returned descriptor and let go when it is closed (or this process dies). Raises
    TimeoutError when no slot frees within ``timeout_s`` seconds."""
    slots = max(1, int(os.environ.get("KVGATE_ENGINE_SLOTS", "3")))
    deadline = time.monotonic() + timeout_s
    while True:
        for i in range(slots):
            fd = os.open(_slot_dir() / f"slot-{i}", os.O_CREAT | os.O_RDWR, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                os.close(fd)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no engine slot free in {timeout_s:.0f} s ({slots} engines already run here)")
        time.sleep(0.5)  # another process's engine holds every slot; flock has no timed wait


@dataclass
class Engine:
    """A running real engine: its process (own group), base URL, spec and log file."""

    proc: procs.Proc
    url: str
    port: int
    spec: EngineSpec
    slot_fd: int | None = None
    started_s: float = 0.0

    @property
    def log_path(self) -> Path:
        return self.proc.log_path

    def stop(self, grace_s: float = 10.0) -> None:
        """End the engine's process group (SIGTERM, then SIGKILL) and give its slot back."""
        try:
            self.proc.stop(grace_s)
        finally:
            if self.slot_fd is not None:
                os.close(self.slot_fd)
                self.slot_fd = None


def start_engine(spec: EngineSpec, log_dir: Path, name: str | None = None, port: int | None = None,
                 timeout_s: float = 900.0, slot_timeout_s: float = 600.0, die_with_launcher: bool = False) -> Engine:
    """Start one engine and wait until GET /health answers 200 (SGLang runs a warm-up generate first, so the
    engine then serves at once). A start took 17-32 s on an idle 2-core machine and 130-240 s with other
    engines, benches and test suites running beside it, hence the generous ``timeout_s`` (seconds). Returns the
    Engine; raises EngineUnavailable when no engine environment is installed, RuntimeError with the log's tail
    when the server exits, TimeoutError after ``timeout_s``, or when no engine slot frees within
    ``slot_timeout_s`` seconds. die_with_launcher: the engine's server gets SIGKILL when the calling thread ends,
    even by SIGKILL (its own scheduler and detokenizer processes follow it: SGLang sets the same on them); only
    from the main thread (kvgate.tools.procs.start says why)."""
    model = model_dir(spec.profile)
    fd = acquire_slot(slot_timeout_s)
    try:
        port = port or procs.free_port()
        cmd, env = sglang_command(spec, port, model)
        t0 = time.monotonic()
        proc = procs.start(name or f"sglang-{port}", cmd, log_dir, env=env, url=f"http://127.0.0.1:{port}",
                           die_with_parent=die_with_launcher)
        eng = Engine(proc, proc.url, port, spec, fd)
        try:
            procs.wait_http(f"{proc.url}/health", timeout_s, proc)
        except BaseException:
            eng.stop()
            raise
        eng.started_s = time.monotonic() - t0
        return eng
    except BaseException:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        raise


def flush_cache(url: str, timeout_s: float = 30.0) -> None:
    """POST /flush_cache: empty the engine's radix cache (SGLang refuses while requests run; retried until it
    answers 200 or ``timeout_s`` passes, then RuntimeError)."""
    import urllib.request
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(f"{url}/flush_cache", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=10) as resp:
                if resp.status == 200:
                    return
                last = str(resp.status)
        except Exception as exc:  # noqa: BLE001 - retried; the last error is reported
            last = str(exc)
        time.sleep(0.2)  # the engine refuses a flush while a request runs; no event to wait on
    raise RuntimeError(f"{url}/flush_cache did not succeed in {timeout_s} s: {last}")
