"""One tiny bench scenario end to end (real smg, simulated engines, kvgate; ~15 s): every arm finishes without
errors on the same workload, and the files are written."""

import argparse
import json

import pytest

from kvgate.tools import procs
from kvgate.bench import command as cli

pytestmark = pytest.mark.skipif(not procs.smg_installed(), reason="smg router not installed")

TINY = """
name: tiny
seed: 1
replicates: 2
speed: 4
engines: 2
max_total_num_tokens: 6000
unbounded_max_total_num_tokens: 400000
arms: [direct, lifecycle+admission, lifecycle+admission-program, router-limit, unbounded-kv, proxy-placement,
       smg-manual]
router_limits: [2]
kvgate_times: {session_idle_close_s: 20, agentic_admission_max_wait_s: 30}
kvgate_extra: {admission_chars_per_token: 1.0, max_response_length: 512}
workload:
  kind: agentic
  groups: 2
  group_size: 2
  task_prompt_tokens: {dist: const, value: 1500}
  turns: {dist: const, value: 3}
  observation_tokens: {dist: const, value: 300}
  output_tokens: {dist: const, value: 32}
  tool_gap_s: {dist: const, value: 1.0}
"""


def run_scenario(tmp_path, text: str) -> tuple[dict, "Path"]:
    """Run ``kvgate bench`` on the scenario ``text``; assert it exits 0; return (results.json, the out dir)."""
    sc = tmp_path / "scenario.yaml"
    sc.write_text(text)
    out = tmp_path / "out"
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args(["--scenario", str(sc), "--out", str(out), "--no-progress"])) == 0
    return json.loads((out / "results.json").read_text()), out


def test_tiny_scenario_end_to_end(tmp_path):
    sc = tmp_path / "tiny.yaml"
    sc.write_text(TINY)
    out = tmp_path / "out"
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    rc = cli.run(p.parse_args(["--scenario", str(sc), "--out", str(out), "--no-progress"]))
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    arms = ["direct", "lifecycle+admission", "lifecycle+admission-program", "router-limit-2", "unbounded-kv",
            "proxy-placement", "smg-manual"]
    assert list(res["metrics"]) == arms and res["seeds"] == [1, 2]
    for arm, m in res["metrics"].items():
        failed = [(r["session"], r["turn"], r["status"], r["error"]) for a in res["arms"][arm] for r in a["requests"]
                  if not r["ok"]]
        assert m["errors"] == 0 and m["requests"] == 12 and m["replicates"] == 2, (arm, failed)
        assert [r["seed"] for r in res["arms"][arm]] == [1, 2]
        # kvgate's placement counters are kept for every kvgate arm: a number of re-openings, none without kvgate
        reopened = [s["reopened_home"] for s in res["metrics_by_seed"][arm]]
        assert all(isinstance(x, int) for x in reopened) if arm not in ("direct", "router-limit-2", "unbounded-kv",
                                                                         "smg-manual") else reopened == [None, None]
        assert m["makespan_s_reps"] == [s["makespan_s"] for s in res["metrics_by_seed"][arm]]
        assert m["makespan_s"] == pytest.approx(sum(m["makespan_s_reps"]) / 2)
    assert sorted(a for t in res["tiers"] for a in t) == sorted(arms)
    for i in range(2):
        # the same workload in every arm for a seed: identical prompt lengths and output token counts, turn by turn
        shapes = {arm: sorted((r["session"], r["turn"], r["prompt_len"], r["output_tokens"])
                              for r in a[i]["requests"]) for arm, a in res["arms"].items()}
        assert len({json.dumps(v) for v in shapes.values()}) == 1
        # turn 2 re-uses the cached turn-1 prompt + output (all but the last output token) where the router keeps
        # a session on one engine (manual policy, by the client's X-SMG-Routing-Key; smg 1.13's cache_aware
        # does not always, at this size)
        t2 = [r for r in res["arms"]["smg-manual"][i]["requests"] if r["turn"] == 2]
        assert all(r["cached_tokens"] >= 1500 + 12 + 32 - 1 for r in t2)
        la = res["arms"]["lifecycle+admission"][i]
        assert la["closes"] == {"200": 4} and res["arms"]["direct"][i]["closes"] == {"404": 4}
        # turns go to /generate, where kvgate places the sessions of its lifecycle arms, so the engines see every
        # session id (each on one engine); without lifecycle no id reaches them
        assert sum(la["sim_engines_sessions_seen"]) == 4
        assert sum(res["arms"]["direct"][i]["sim_engines_sessions_seen"]) == 0
        assert sum(res["arms"]["proxy-placement"][i]["sim_engines_sessions_seen"]) == 0
        # each session on exactly one engine; the four start at once, so the two engines get two each: a GRPO
        # sibling does not follow its group's prompt onto the busier engine (placement balances running and
        # waiting requests, docs/placement.md)
        per_engine = la["sim_engines_session_ids"]
        assert sorted(sid for ids in per_engine for sid in ids) == sorted(f"st0-g{g}-s{k}" for g in (0, 1)
                                                                       for k in (0, 1))
        assert sorted(len(ids) for ids in per_engine) == [2, 2]
        # sticky placement: every later turn re-uses the session's cached prompt + output on its engine
        for arm in ("lifecycle+admission", "proxy-placement"):
            later = [r for r in res["arms"][arm][i]["requests"] if r["turn"] == 2]
            assert all(r["cached_tokens"] >= 1500 + 12 + 32 - 1 for r in later), arm
        c = la["kvgate_counters"]
        assert c["admit"] + c["bypass_protected"] + c["bypass_degraded"] + c["bypass_aged"] == 12
        lp = res["arms"]["lifecycle+admission-program"][i]
        assert lp["closes"] == {"200": 4}
        c = lp["kvgate_counters"]
        assert c["admit"] + c["bypass_protected"] + c["bypass_degraded"] + c["bypass_aged"] == 12
        assert c["resume"] <= c["pause"]
    md = (out / "report.md").read_text()
    assert "mean ± 95% CI, 2 seeds" in md and "Ranking by step makespan:" in md
    assert "Placement (both kvgate features off):" in md and "| kvgate placement (proxy-placement) |" in md
    assert res["metrics"]["lifecycle+admission"]["engine_sessions_seen"] == 4
    for f in ("report.md", "latency_cdf.png", "kv_timeseries.png", "ratios.png"):
        assert (out / f).stat().st_size > 0


def test_compare_with_an_earlier_run(tmp_path):
    prev = tmp_path / "prev"
    prev.mkdir()
    prev_tiers = [["unbounded-kv"], ["direct", "lifecycle"], ["admission"]]
    (prev / "results.json").write_text(json.dumps({"tiers": prev_tiers,
                                                   "ranking": ["unbounded-kv", "direct", "lifecycle", "admission"]}))
    loaded = cli._load_previous(str(prev))
    same = cli._compare([["unbounded-kv"], ["lifecycle", "direct"], ["admission"]],
                        ["unbounded-kv", "lifecycle", "direct", "admission"], loaded)
    assert same["same_ranking"] is True and same["kendall_tau"] == pytest.approx(4 / 6)
    assert "the same ranking" in same["text"]
    other = cli._compare([["unbounded-kv"], ["direct"], ["lifecycle"], ["admission"]],
                         ["unbounded-kv", "direct", "lifecycle", "admission"], loaded)
    assert other["same_ranking"] is False and other["kendall_tau"] == 1.0 and "DIFFERENT" in other["text"]
    (prev / "results.json").write_text("{}")
    with pytest.raises(ValueError, match="not a kvgate bench results.json"):
        cli._load_previous(str(prev))


SWEEP = TINY.replace("replicates: 2", "replicates: 2").replace(
    """arms: [direct, lifecycle+admission, lifecycle+admission-program, router-limit, unbounded-kv, proxy-placement,
       smg-manual]""",
    """arms: [router-sweep, lifecycle]
router_sweep:
  - {name: round_robin, policy: round_robin}
  - {name: consistent_hashing-noprot, policy: consistent_hashing, extra: [--disable-worker-overload-protection]}""")


def test_router_sweep_best_becomes_direct(tmp_path):
    """The router-sweep arm runs each router configuration router-only; the one that finished soonest becomes
    ``direct`` (named in results.json and the report), and every configuration is in the sweep table."""
    res, out = run_scenario(tmp_path, SWEEP)
    best = res["best_router"]
    assert best["arm"] in ("router-round_robin", "router-consistent_hashing-noprot")
    other = ({"router-round_robin", "router-consistent_hashing-noprot"} - {best["arm"]}).pop()
    assert list(res["metrics"]) == ["direct", other, "lifecycle"]
    assert res["metrics"]["direct"]["makespan_s"] <= res["metrics"][other]["makespan_s"]
    assert best["renamed_to"] == "direct"
    # each configuration's own flags reached smg: consistent hashing keeps a session on one engine by its
    # routing key (every later turn hits its cache), round_robin alternates engines
    ch = res["arms"]["direct" if best["arm"] == "router-consistent_hashing-noprot" else other]
    for rep in ch:
        later = [r for r in rep["requests"] if r["turn"] == 2]
        assert all(r["cached_tokens"] >= 1500 + 12 + 32 - 1 for r in later)
    assert best["policy"] == ("consistent_hashing" if best["arm"].startswith("router-consistent") else "round_robin")
    md = (out / "report.md").read_text()
    assert f"Router sweep (router only, no kvgate; best: {best['arm']}):" in md
    assert f"| {other} |" in md and f"| {best['arm']} | " in md
    assert f"`direct` is the best router configuration of the sweep, {best['arm']}" in md


TINY_PD = """
name: tiny-pd
seed: 1
speed: 4
prefill_engines: 1
engines: 2
max_total_num_tokens: 6000
unbounded_max_total_num_tokens: 400000
router_extra: [--decode-policy, consistent_hashing]
arms: [direct, lifecycle]
kvgate_times: {session_idle_close_s: 20}
workload:
  kind: agentic
  groups: 2
  group_size: 2
  task_prompt_tokens: {dist: const, value: 1500}
  turns: {dist: const, value: 3}
  observation_tokens: {dist: const, value: 300}
  output_tokens: {dist: const, value: 32}
  tool_gap_s: {dist: const, value: 1.0}
"""


def test_tiny_pd_scenario_end_to_end(tmp_path):
    """A PD fleet (1 prefill + 2 decode simulated workers behind smg --pd-disaggregation, decode policy
    consistent_hashing on the client's routing key): both arms finish every turn; each session's later turns hit
    its decode worker's cache; every worker, prefill included, saw every session's turns (the prefill worker all of
    them), and kvgate's lifecycle closes every session."""
    res, _ = run_scenario(tmp_path, TINY_PD)
    for arm in ("direct", "lifecycle"):
        m = res["metrics"][arm]
        assert m["errors"] == 0 and m["requests"] == 12, arm
        (run,) = res["arms"][arm]
        later = [r for r in run["requests"] if r["turn"] == 2]
        assert all(r["cached_tokens"] >= 1500 + 12 + 32 - 1 for r in later), arm
    lc = res["arms"]["lifecycle"][0]
    assert lc["closes"] == {"200": 4}
    prefill, *decode = lc["sim_engines_session_ids"]
    assert len(prefill) == 4 and sorted(s for ids in decode for s in ids) == sorted(prefill)
