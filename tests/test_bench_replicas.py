"""The bench's several-replica arm end to end: a redis-server of the arm's own, two kvgate replicas sharing
state on it (state_backend: redis), the rollout's sessions split between them (real smg, simulated engines)."""

import argparse
import json

import pytest

from kvgate.bench import command as cli
from kvgate.bench.runner import ALTERNATE, replica_for
from kvgate.tools import procs

TINY = """
name: tiny-replicas
seed: 1
replicates: 1
speed: 4
engines: 2
max_total_num_tokens: 12000
arms: [lifecycle+admission-2replicas]
kvgate_times: {session_idle_close_s: 20, agentic_admission_max_wait_s: 30}
kvgate_extra: {admission_chars_per_token: 1.0, max_response_length: 512}
workload:
  kind: agentic
  groups: 2
  group_size: 4
  task_prompt_tokens: {dist: const, value: 1500}
  turns: {dist: const, value: 3}
  observation_tokens: {dist: const, value: 300}
  output_tokens: {dist: const, value: 32}
  tool_gap_s: {dist: const, value: 1.0}
"""


def test_replica_for_splits_sessions_and_alternates_some():
    assert [replica_for(i, 0, 2) for i in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    # sessions ALTERNATE-1, 2*ALTERNATE-1, ...: turns (and the close) go round the replicas; the others stay
    i = ALTERNATE - 1
    assert [replica_for(i, k, 2) for k in range(4)] == [1, 0, 1, 0]
    assert [replica_for(i, k, 3) for k in range(4)] == [(i + k) % 3 for k in range(4)]
    assert {replica_for(0, k, 2) for k in range(5)} == {0}
    assert {replica_for(5, k, 1) for k in range(5)} == {0}


@pytest.mark.skipif(not procs.smg_installed(), reason="smg router not installed")
@pytest.mark.skipif(procs.find_executable("redis-server") is None and not __import__("os").path.exists(
    "/usr/bin/redis-server"), reason="redis-server not installed (Debian package redis-server)")
def test_two_replica_arm_end_to_end(tmp_path):
    sc = tmp_path / "tiny.yaml"
    sc.write_text(TINY)
    out = tmp_path / "out"
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    rc = cli.run(p.parse_args(["--scenario", str(sc), "--out", str(out), "--no-progress"]))
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    m = res["metrics"]["lifecycle+admission-2replicas"]
    assert m["errors"] == 0 and m["requests"] == 24
    raw = res["arms"]["lifecycle+admission-2replicas"][0]
    # every session closed once, through kvgate (some through the replica that did not serve its last turn)
    assert raw["closes"] == {"200": 8}
    # both replicas served requests: sessions 0, 2, 4, 6 on the first, 1, 5 on the second, 3 and 7 on both
    # (turns 1 and 3 on the second, turn 2 on the first)
    reps = raw["kvgate_replicas"]
    assert len(reps) == 2
    per = [r["counters"]["admit"] + r["counters"]["bypass_protected"] + r["counters"]["bypass_degraded"]
           + r["counters"]["bypass_aged"] for r in reps]
    assert per == [4 * 3 + 2 * 1, 2 * 3 + 2 * 2]
    c = raw["kvgate_counters"]
    assert c["admit"] + c["bypass_protected"] + c["bypass_degraded"] + c["bypass_aged"] == 24
    # leases were held against the shared ceiling (Redis answered every grant)
    assert sum(r["shared_leases"]["granted"] + r["shared_leases"]["aged"] for r in reps) == c["admit"]
    assert sum(r["shared_leases"]["bypass"] for r in reps) == c["bypass_protected"] + c["bypass_aged"]
    assert all(r["shared_leases"]["unreachable"] == 0 for r in reps)
    # placement is shared: each session (also the alternating ones) lives on exactly one engine
    ids = raw["sim_engines_session_ids"]
    assert sorted(s for e in ids for s in e) == sorted(f"st0-g{g}-s{k}" for g in (0, 1) for k in range(4))
    # and every later turn re-uses its session's cached prompt + output there
    later = [r for r in raw["requests"] if r["turn"] == 2]
    assert all(r["cached_tokens"] >= 1500 + 12 + 32 - 1 for r in later)
