"""scripts/bench_program_decisions.py: the program policy's decision cost, alone and in lockstep with another tree.

Small fleets (the figures at 64 engines and 4,096 programs are for the benchmark, not a test): the run decides
(turns, pauses, moves), times every call, and a baseline tree run beside it decides the same, call by call.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_program_decisions.py"


def _run(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_small_fleet_decides_and_every_call_is_timed(tmp_path):
    out = tmp_path / "r.json"
    r = _run("--engines", "4", "--programs", "96", "--tokens", "20000", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["turns"] >= 96 * 2 and rep["pauses"] > 0 and rep["moved"] > 0  # the fleet filled
    assert rep["calls"]["submit"]["calls"] == rep["turns"] == rep["calls"]["release"]["calls"]
    for call in ("submit", "release", "next_deadline"):
        c = rep["calls"][call]
        assert 0 < c["p50_us"] <= c["p99_us"] <= c["max_us"]
    assert rep["tracemalloc_peak_mib"] > 0
    assert len(rep["decisions_sha256"]) == 16 and rep["decisions_sha256"] in r.stdout


def test_a_baseline_tree_runs_in_lockstep_and_must_decide_alike(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(ROOT / "kvgate", base / "kvgate", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "r.json"
    args = ("--engines", "4", "--programs", "64", "--tokens", "20000", "--no-memory")
    r = _run(*args, "--baseline", str(base), "--out", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["baseline"]["decisions_sha256"] == rep["decisions_sha256"]
    assert rep["baseline"]["tree"] == "base"  # not a git tree: its directory's name, no path of this machine
    assert rep["baseline"]["calls"]["submit"]["calls"] == rep["calls"]["submit"]["calls"] == rep["turns"]
    assert "timed in lockstep" in r.stdout
    # a tree that decides otherwise is refused, not timed against this one
    prog = base / "kvgate" / "admission" / "ledger.py"
    prog.write_text(prog.read_text().replace("self.headroom = ", "self.headroom = 0.5 * ", 1))
    r = _run(*args, "--baseline", str(base))
    assert r.returncode != 0 and "decided differently" in r.stderr
    # a directory without kvgate in it: one clear line
    r = _run(*args, "--baseline", str(tmp_path / "nowhere"))
    assert r.returncode != 0 and "no kvgate package there" in r.stderr
