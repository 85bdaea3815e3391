"""`kvgate demo` end to end as a user runs it (subprocesses: four engines, smg, kvgate), on a short window."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.tools import procs
from kvgate.bench.trace import infer_sessions, read_trace

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not procs.smg_installed(), reason="the smg router is not installed")
def test_demo_short_window_every_run(tmp_path):
    out = tmp_path / "summary.json"
    res = subprocess.run([sys.executable, "-m", "kvgate", "demo", "--duration-s", "10", "--speed", "4",
                          "--sessions", "all", "--runs", "all", "--idle-close-s", "4", "--json", str(out),
                          "--log-dir", str(tmp_path / "logs")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, start_new_session=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = read_trace(ROOT / "kvgate" / "data" / "mooncake_slice.jsonl", 0, 10_000)
    n_sessions = len(set(infer_sessions(records)))
    alone, lifecycle, admission = json.loads(out.read_text())
    assert (alone["run"], alone["router_policy"], alone["engines"]) == ("smg", "cache_aware", 4)
    assert alone["requests"] == len(records) == alone["ok"] and alone["errors"] == {}
    assert alone["prompt_tokens"] == sum(r.input_length for r in records)  # the same replay as the kvgate runs
    for s in (lifecycle, admission):
        assert s["against_smg"].startswith(f"result: kvgate (session lifecycle{' + admission' if s is admission else ''}"
                                           f")")
        assert s["against_smg"] in res.stdout  # printed as the run's last line
        assert s["requests"] == len(records) == s["ok"] and s["errors"] == {}
        assert s["sessions"] == n_sessions == s["sessions_closed"]
        assert s["not_adding_up"] == []  # every printed sum adds up (tests/test_demo_figures.py: the arithmetic)
        total = sum(s["closes_by_reason"].values())
        assert s["close_failures"] == 0 and total >= n_sessions
        engines = len(s["engine_closes_received"])
        assert engines == 4 and s["route"] == "generate" and s["placed_by"] == "kvgate"
        assert s["close_calls"] == engines * total == sum(s["engine_closes_received"])  # every close, every engine
        assert s["engine_sessions_union"] == n_sessions  # session_id reached an engine for every session
        assert s["prompt_tokens"] == sum(r.input_length for r in records)
    assert lifecycle["admission_stats"] is None
    c = admission["admission_stats"]["counters"]
    assert c["admit"] + c["bypass_protected"] + c["bypass_degraded"] + c["bypass_aged"] == len(records)
    assert c["bypass_degraded"] == 0  # the demo waits for the first capacity snapshot
    assert "summary" in res.stdout and "admission  admit" in res.stdout and "DOES NOT ADD UP" not in res.stdout
    # the idle close is said once, with where it came from (here the flag; by default the window's gaps)
    assert lifecycle["idle_close_s"] == admission["idle_close_s"] == 4.0
    assert res.stdout.count("kvgate demo: idle close 4 s of trace time (--idle-close-s; 1 s at speed 4); ") == 1


@pytest.mark.skipif(not procs.smg_installed(), reason="the smg router is not installed")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGHUP", "SIGINT-repeated"])
def test_demo_signal_stops_every_child(tmp_path, how):
    """kill, a closed terminal, and Ctrl-C pressed again and again while the demo is stopping its children:
    every engine, router and kvgate process it started is gone afterwards. Each step waits for a line the demo
    prints, never for time. Its output is read all along (a full pipe would stop the demo), and a demo still
    running a minute after the signal fails the test with where it is (`kill -USR1`: its threads' stacks)."""
    import os
    import signal
    import threading
    log_dir = tmp_path / "logs"
    # SIGINT at its default, as in an interactive terminal: a test runner started as a background job of a
    # non-interactive shell has it ignored, and the demo would inherit that (and rightly keep ignoring it).
    # 300 s of trace at speed 5 replays for a minute: the first progress line (10 s in) comes mid-replay.
    p = subprocess.Popen([sys.executable, "-m", "kvgate", "demo", "--duration-s", "300", "--runs", "lifecycle",
                          "--sessions", "all",
                          "--log-dir", str(log_dir)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[bytes] = []
    seen = {k: threading.Event() for k in (b"requests done", b"stopping the", b"most recent call first")}

    def read() -> None:
        for line in p.stdout:
            lines.append(line)
            for k, ev in seen.items():
                if k in line:
                    ev.set()
        for ev in seen.values():
            ev.set()  # the demo ended: nothing more will come

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def ended(timeout: float) -> int:
        """The demo's exit status; a failure with its output and its threads' stacks if it is still running."""
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGUSR1)
            seen[b"most recent call first"].wait(10)
            pytest.fail(f"the demo still ran {timeout:.0f} s after the signal:\n" + b"".join(lines).decode(errors="replace"))

    children = []
    try:
        # the replay has started once the demo prints its first progress line (an event in its output)
        assert seen[b"requests done"].wait(300) and p.poll() is None, b"".join(lines).decode(errors="replace")
        kvgate_log = (log_dir / "lifecycle" / "kvgate.log").read_text()
        assert "listening" in kvgate_log
        children = _descendants(p.pid)
        assert len(children) >= 6  # four engines, the router (launcher + smg::router), kvgate
        if how == "SIGINT-repeated":
            p.send_signal(signal.SIGINT)
            assert seen[b"stopping the"].wait(60)  # it has begun stopping its children: press again and again now
            for _ in range(10):
                p.send_signal(signal.SIGINT)
            assert ended(60) == 130
            reader.join(10)
            rest = b"".join(lines)
            assert b"Traceback" not in rest and b"interrupted" in rest
        else:
            sig = getattr(signal, how)
            p.send_signal(sig)
            assert ended(60) == 128 + sig
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            for pid in children:  # a demo that did not stop its children: they run in sessions of their own
                try:
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
    alive = []
    for pid in children:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    assert alive == []


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children started in their own sessions keep their parent)."""
    out, todo = [], [pid]
    while todo:
        ps = subprocess.run(["ps", "-o", "pid=", "--ppid", str(todo.pop())], capture_output=True, text=True)
        kids = [int(x) for x in ps.stdout.split()]
        out += kids
        todo += kids
    return out
