"""A short `kvgate demo --engine sglang` run, as a user runs it, on the tier's real engines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvgate.bench.trace import infer_sessions, read_trace

ROOT = Path(__file__).resolve().parents[2]


def test_demo_on_real_engines(fleet, tmp_path):
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "kvgate", "demo", "--engine", "sglang", "--duration-s", "5", "--speed", "2",
           "--idle-close-s", "4", "--runs", "admission", "--sessions", "all", "--json", str(out),
           "--log-dir", str(tmp_path / "logs")]
    for u in fleet.urls:
        cmd += ["--engine-url", u]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, start_new_session=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = read_trace(ROOT / "kvgate" / "data" / "mooncake_slice.jsonl", 0, 5_000)
    n_sessions = len(set(infer_sessions(records)))
    (s,) = json.loads(out.read_text())
    assert s["engine"] == "sglang" and s["engines"] == len(fleet.urls) and s["token_scale"] == 32
    assert s["requests"] == len(records) == s["ok"] and s["errors"] == {}
    assert s["sessions"] == n_sessions == s["sessions_closed"] and s["not_adding_up"] == []
    assert s["close_failures"] == 0 and s["close_calls"] == len(fleet.urls) * sum(s["closes_by_reason"].values())
    # The prompt tokens the real engines counted are the scaled trace's (every id inside the tiny vocabulary).
    assert s["prompt_tokens"] == sum(max(1, r.input_length // 32) for r in records)
    c = s["admission_stats"]["counters"]
    assert c["admit"] + c["bypass_protected"] + c["bypass_degraded"] + c["bypass_aged"] == len(records)
    assert c["bypass_degraded"] == 0
    assert "real engines do not report the session ids" in res.stdout
