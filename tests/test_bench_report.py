"""The report's arithmetic on a tiny hand-made scenario (pure)."""

import math

import pytest

from kvgate.bench.report import markdown, percentile, ranking, ratios, summarize

# two sessions of one step, speed 2 (so every wall second below is 2 simulated seconds)
RAW = {
    "requests": [
        {"session": "a", "start": 0.0, "ttft": 0.5, "end": 1.0, "ok": True, "output_tokens": 10,
         "queue_ms": 100.0},
        {"session": "a", "start": 2.0, "ttft": 2.25, "end": 3.0, "ok": True, "output_tokens": 20, "queue_ms": 0.0,
         "retries": 3},
        {"session": "b", "start": 0.0, "ttft": 1.0, "end": 2.0, "ok": True, "output_tokens": 30,
         "queue_ms": 300.0},
        {"session": "b", "start": 3.0, "ttft": None, "end": 3.5, "ok": False, "output_tokens": 0,
         "queue_ms": None},
    ],
    "sessions": [{"id": "a", "step": 0, "start": 0.0, "end": 3.0, "ok": True},
                 {"id": "b", "step": 0, "start": 0.0, "end": 3.5, "ok": False}],
    "steps": [{"step": 0, "start": 0.0, "end": 4.0}],
    "sim_totals": {"prompt_tokens": 1000, "cached_tokens": 600, "evicted_tokens": 50, "retractions": 2,
                   "aborted": 0},
    "kvgate_counters": {"admit": 2, "wait": 1, "bypass_protected": 0, "bypass_degraded": 1, "bypass_aged": 0,
                        "cancelled": 0},
}


def test_percentile_nearest_rank():
    assert percentile([1, 2, 3, 4], 50) == 2
    assert percentile([1, 2, 3, 4], 99) == 4
    assert percentile([5], 1) == 5
    assert math.isnan(percentile([], 50))


def test_summarize_hand_computed():
    m = summarize(RAW, speed=2.0, ideal_prefill_tokens=300)
    assert m["makespan_s"] == 8.0                      # (4 - 0) x 2
    assert m["session_mean_s"] == 6.0                  # only session a is ok: 3 x 2
    assert m["session_p50_s"] == 6.0 and m["session_p99_s"] == 6.0
    # ok turn latencies 1, 1, 2 wall -> 2, 2, 4 simulated
    assert m["turn_p50_s"] == 2.0 and m["turn_p99_s"] == 4.0
    # TTFTs 0.5, 0.25, 1.0 wall -> 1.0, 0.5, 2.0
    assert m["ttft_p50_s"] == 1.0 and m["ttft_p99_s"] == 2.0
    # 60 output tokens over the span of the first start (0) to the last ok end (3.0) wall = 6 s simulated
    assert m["output_tok_per_s"] == 10.0
    assert m["cache_hit_rate"] == 0.6
    assert m["prefill_computed_tokens"] == 400 and m["recomputed_prefill_tokens"] == 100
    assert (m["evicted_tokens"], m["retractions"], m["errors"], m["requests"], m["retries"]) == (50, 2, 1, 4, 3)
    # queue waits 100, 0, 300 ms wall -> 0.2, 0, 0.6 s simulated
    assert m["queue_p50_s"] == pytest.approx(0.2) and m["queue_p99_s"] == pytest.approx(0.6)
    assert m["admit_wait_bypass"] == "2/1/1"


def test_recomputed_never_negative_and_no_kvgate_columns_without_kvgate():
    raw = {**RAW, "kvgate_counters": None,
           "requests": [{**r, "queue_ms": None} for r in RAW["requests"]]}
    m = summarize(raw, 1.0, ideal_prefill_tokens=10_000)
    assert m["recomputed_prefill_tokens"] == 0
    assert m["queue_p50_s"] is None and m["admit_wait_bypass"] == "-"


def test_ratios_and_table_and_ranking():
    a = summarize(RAW, 2.0, 300)
    b = {**a, "makespan_s": 4.0, "output_tok_per_s": 20.0}
    metrics = {"direct": a, "unbounded-kv": b}
    r = ratios(metrics, "direct")
    assert r["unbounded-kv"]["makespan_s"] == 0.5 and r["unbounded-kv"]["output_tok_per_s"] == 2.0
    assert r["direct"]["makespan_s"] == 1.0
    assert ratios(metrics, "lifecycle") == {}
    assert ranking(metrics) == ["unbounded-kv", "direct"]
    # an arm with errors ranks last even with a shorter makespan (its sessions ended early)
    assert ranking({"direct": {**a, "errors": 0}, "router-limit-8": {**a, "makespan_s": 1.0, "errors": 5}}) == [
        "direct", "router-limit-8"]
    md = markdown(metrics, "hdr")
    assert "| direct | 8.0 | 6.0 |" in md
    assert "Ratio to direct" in md and "Ratio to unbounded-kv" in md
    assert "| unbounded-kv | 0.50 |" in md


def test_session_accuracy_from_kvgate_named_turns():
    from kvgate.bench.report import session_accuracy
    # truth: a has 3 turns, b has 2; kvgate split a's third turn off and merged nothing
    reqs = [{"session": "a", "kv_session": "x"}, {"session": "a", "kv_session": "x"},
            {"session": "a", "kv_session": "y"}, {"session": "b", "kv_session": "z"},
            {"session": "b", "kv_session": "z"}]
    precision, recall = session_accuracy(reqs)
    # predicted same-session pairs: (a1,a2), (b1,b2) = 2, both true; true pairs: 3 (a) + 1 (b) = 4
    assert (precision, recall) == (1.0, 0.5)
    assert session_accuracy([{"session": "a", "kv_session": None}]) == (None, None)
    merged = [{"session": "a", "kv_session": "m"}, {"session": "b", "kv_session": "m"}]
    assert session_accuracy(merged) == (0.0, 1.0)  # one predicted pair, wrong; no true pairs -> recall 1


def test_aggregate_means_over_seeds_and_the_replicated_table():
    from kvgate.bench.report import aggregate, ranked_tiers
    a = summarize(RAW, 2.0, 300)                              # makespan 8
    b = summarize({**RAW, "steps": [{"step": 0, "start": 0.0, "end": 5.0}]}, 2.0, 300)   # makespan 10
    m = aggregate([a, b])
    assert m["makespan_s"] == 9.0 and m["makespan_s_reps"] == [8.0, 10.0] and m["replicates"] == 2
    assert m["admit_wait_bypass"] == "2/1/1" and m["bypass_by_reason"]["degraded"] == 1
    assert m["cache_hit_rate"] == 0.6
    none = aggregate([{**a, "queue_p50_s": None}, {**b, "queue_p50_s": None}])
    assert none["queue_p50_s"] is None
    # direct: 8, 10; slow: 2 s slower on both seeds -> +2.0 +- 0.0 and a tier of its own
    direct = aggregate([{**a, "errors": 0}, {**b, "errors": 0}])
    slow = aggregate([{**a, "errors": 0, "makespan_s": 10.0}, {**b, "errors": 0, "makespan_s": 12.0}])
    md = markdown({"direct": direct, "slow": slow})
    assert "step makespan s (mean ± 95% CI, 2 seeds) | vs direct s (paired, 95%) |" in md
    # 8, 10 -> mean 9, sd 1.414, half-width 12.706 x 1.414 / 1.414 = 12.706; slow - direct = +2 on both seeds
    assert "| direct | 9.0 ± 12.7 | - |" in md and "| slow | 11.0 ± 12.7 | +2.0 ± 0.0 |" in md
    # no residual noise, but two arms on two seeds cannot pass Scott-Knott's 99% test (lambda <= 1.376 x 3)
    ts, se, df = ranked_tiers({"direct": direct, "slow": slow})
    assert ts == [["direct", "slow"]] and se == 0.0 and df == 1
    # the difference's interval pools the residual over every arm: noise of +-1 on one arm's seeds
    from kvgate.bench.report import vs_base
    noisy = aggregate([{**a, "errors": 0, "makespan_s": 11.0}, {**b, "errors": 0, "makespan_s": 11.0}])
    d = vs_base({"direct": direct, "slow": slow, "noisy": noisy})
    # residuals (value - arm mean - seed mean + grand mean): +-1/3 for direct and slow, +-2/3 for noisy ->
    # SS = 4/9 + 8/9 = 4/3 on (3-1)(2-1) = 2 df, MSE = 2/3; half-width t(2) x sqrt(2 x MSE / 2 seeds)
    assert d["slow"][0] == 2.0 and d["noisy"][0] == 2.0
    assert d["slow"][1] == pytest.approx(4.303 * (2 / 3) ** 0.5, abs=1e-3) and d["noisy"][1] == d["slow"][1]
    assert vs_base({"slow": slow}) == {}
    # an arm with errors is last whatever its makespan
    bad = aggregate([{**a, "makespan_s": 1.0}, {**b, "makespan_s": 1.0}])
    assert ranked_tiers({"direct": direct, "bad": bad}) == ([["direct"], ["bad"]], None, 0)


def test_pauses_and_resumes_survive_the_mean_over_seeds():
    from kvgate.bench.report import aggregate
    prog = {"admit": 2, "wait": 1, "bypass": 0, "bypass_protected": 0, "bypass_degraded": 0, "bypass_aged": 0,
            "pause": 545, "resume": 533}
    a = summarize({**RAW, "kvgate_counters": prog}, 1.0, 0)
    b = summarize({**RAW, "kvgate_counters": {**prog, "pause": 455, "resume": 467}}, 1.0, 0)
    assert a["pause_resume"] == "545/533" and (a["pauses"], a["resumes"]) == (545, 533)
    m = aggregate([a, b])
    assert m["pause_resume"] == "500/500" and m["pauses"] == 500.0
    fifo = aggregate([summarize(RAW, 1.0, 0), summarize(RAW, 1.0, 0)])   # fifo counters have no "pause"
    assert fifo["pause_resume"] == "-" and fifo["pauses"] is None
    # the resident bound's waits, where the policy counts them
    bound = [summarize({**RAW, "kvgate_counters": {**prog, "wait_resident_bound": n}}, 1.0, 0) for n in (30, 40)]
    assert aggregate(bound)["bound_waits"] == 35.0 and m["bound_waits"] is None and fifo["bound_waits"] is None


def test_reopened_sessions_home_or_elsewhere_from_kvgates_placement_counters():
    from kvgate.bench.report import aggregate
    a = summarize({**RAW, "kvgate_placement": {"reopened": 11, "reopen_elsewhere": 33, "sticky": 400}}, 1.0, 0)
    b = summarize({**RAW, "kvgate_placement": {"reopened": 13, "reopen_elsewhere": 1, "sticky": 380}}, 1.0, 0)
    assert a["reopen_home_elsewhere"] == "11/33" and (a["reopened_home"], a["reopened_elsewhere"]) == (11, 33)
    assert aggregate([a, b])["reopen_home_elsewhere"] == "12/17"
    none = summarize({**RAW, "kvgate_placement": {"reopened": 0, "reopen_elsewhere": 0}}, 1.0, 0)
    assert none["reopen_home_elsewhere"] == "-" and summarize(RAW, 1.0, 0)["reopened_home"] is None
