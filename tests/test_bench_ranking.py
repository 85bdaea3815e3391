"""Replicate statistics and tiered ranking of bench arms (pure, kvgate.bench.ranking)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.bench.ranking import (block_mse, contradictions, kendall_tau, mean_ci, same_ranking, scott_knott, t975,
                                  tier_text, tiers)


def test_mean_ci_hand_computed():
    # mean 2, sample sd 1, n 3 -> half-width t(2) x 1 / sqrt(3) = 4.303 / 1.732
    m, hw = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and hw == pytest.approx(4.303 / math.sqrt(3), rel=1e-3)
    assert mean_ci([5.0]) == (5.0, None)
    with pytest.raises(ValueError):
        mean_ci([])
    assert t975(1) == pytest.approx(12.706, abs=1e-3) and t975(100000) == pytest.approx(1.960, abs=1e-3)
    with pytest.raises(ValueError):
        t975(0)


def test_block_mse_hand_computed():
    # two arms, three seeds: d = b - a = 1, 3, 2 (mean 2). Residuals of the additive model are +-(d_j - 2) / 2,
    # so SS = 2 x (0.25 + 0.25 + 0) = 1, df = (2-1)(3-1) = 2, MSE = 0.5 = var(d) / 2: the paired design.
    mse, df = block_mse({"a": [10.0, 20.0, 30.0], "b": [11.0, 23.0, 32.0]})
    assert (mse, df) == (pytest.approx(0.5), 2)
    assert block_mse({"a": [1.0], "b": [2.0]}) == (None, 0)
    assert block_mse({"a": [1.0, 2.0]}) == (None, 0)
    with pytest.raises(ValueError):
        block_mse({"a": [1.0, 2.0], "b": [1.0]})


def test_scott_knott_hand_computed_split():
    # means 0, 0, 10, 10 with variance of a mean 1 on 6 df: best cut in the middle, B0 = 4 x 25 = 100;
    # sigma^2 = (100 + 6 x 1) / (4 + 6) = 10.6; lambda = pi / (2 (pi - 2)) x 100 / 10.6 = 12.98 >
    # chi2 isf(0.01, 4 / (pi - 2) = 3.50 df) ~ 12.4 -> split; each half has no spread -> stays whole.
    from scipy.stats import chi2
    lam = math.pi / (2 * (math.pi - 2)) * 100 / 10.6
    assert lam > chi2.isf(0.01, 4 / (math.pi - 2))
    assert scott_knott({"a": 0.0, "b": 0.0, "c": 10.0, "d": 10.0}, 1.0, 6) == [["a", "b"], ["c", "d"]]
    # the same means with 4x the noise: lambda = 1.376 x 100 / 12.4 = 11.1 < 12.4 -> one group
    assert scott_knott({"a": 0.0, "b": 0.0, "c": 10.0, "d": 10.0}, 4.0, 6) == [["a", "b", "c", "d"]]


def test_tiers_group_what_the_seeds_cannot_separate():
    # the bench's shape: 8 arms x 4 seeds; seeds differ by up to 60 s (workloads), arms by noise of ~+-10 s,
    # except unbounded-kv (100 s faster) and admission (80 s slower)
    seed = [0.0, 40.0, -20.0, 60.0]
    noise = {"direct": [5, -8, 3, 0], "proxy-only": [-6, 4, 9, -7], "lifecycle": [2, 7, -10, 1],
             "lifecycle+admission": [-3, -9, 6, 8], "router-limit-8": [10, 0, -4, -6],
             "router-limit-16": [-8, 6, 2, 5], "unbounded-kv": [4, -5, -2, 3], "admission": [-2, 3, 7, -8]}
    level = {a: 400.0 for a in noise} | {"unbounded-kv": 300.0, "admission": 480.0}
    samples = {a: [level[a] + seed[j] + noise[a][j] for j in range(4)] for a in noise}
    ts = tiers(samples)
    assert ts[0] == ["unbounded-kv"] and ts[-1] == ["admission"] and len(ts) == 3
    assert sorted(ts[1]) == sorted(a for a in noise if a not in ("unbounded-kv", "admission"))
    assert tier_text(ts).startswith("unbounded-kv < {") and tier_text(ts).endswith("} < admission")


def test_an_even_spread_within_the_noise_stays_one_tier():
    # five arms 10 s apart with per-seed noise of +-30 s: a pairwise test would chain or split; Scott-Knott
    # finds no significant partition
    noise = [[-30.0, 25.0, 5.0], [20.0, -28.0, 8.0], [3.0, 30.0, -33.0], [-25.0, -5.0, 30.0], [28.0, 2.0, -30.0]]
    samples = {f"arm{i}": [500.0 + 10 * i + n for n in noise[i]] for i in range(5)}
    assert len(tiers(samples)) == 1


def test_one_replicate_is_the_plain_order_and_failed_arms_come_last():
    ts = tiers({"a": [3.0], "b": [1.0], "c": [2.0], "bad": [0.5]}, failed=["bad"])
    assert ts == [["b"], ["c"], ["a"], ["bad"]]


def test_same_ranking_ignores_order_inside_a_tier_and_arms_only_one_run_has():
    a = [["u"], ["d", "p"], ["x"]]
    assert same_ranking(a, [["u"], ["p", "d"], ["x"]])
    assert same_ranking(a, [["u"], ["p", "d"], ["x"], ["extra"]])
    assert not same_ranking(a, [["u"], ["p"], ["d"], ["x"]])      # a tie split
    assert not same_ranking(a, [["d", "p"], ["u"], ["x"]])        # tiers swapped


def test_contradictions_are_opposite_orders_only():
    a = [["u"], ["d", "p"], ["x"]]
    assert contradictions(a, [["u"], ["d", "p", "x"]]) == []          # a tie is not a contradiction
    assert contradictions(a, [["u", "d", "p", "x"]]) == []
    assert contradictions(a, [["u"], ["x"], ["d", "p"]]) == [("d", "x"), ("p", "x")]


def test_kendall_tau():
    assert kendall_tau(["a", "b", "c"], ["a", "b", "c"]) == 1.0
    assert kendall_tau(["a", "b", "c"], ["c", "b", "a"]) == -1.0
    assert kendall_tau(["a", "b", "c", "d"], ["b", "a", "c", "d"]) == pytest.approx(4 / 6)
    assert kendall_tau(["a"], ["a"]) == 1.0


@given(st.dictionaries(st.sampled_from(list("abcdefg")),
                       st.lists(st.floats(min_value=0, max_value=1e4), min_size=3, max_size=3), min_size=1))
def test_tiers_partition_the_arms_in_mean_order(samples):
    ts = tiers(samples)
    flat = [a for t in ts for a in t]
    assert sorted(flat) == sorted(samples)
    means = [sum(samples[a]) / 3 for a in flat]
    assert means == sorted(means)
    assert same_ranking(ts, ts)


def test_rank_stability_script_on_a_clear_case(tmp_path, capsys, monkeypatch):
    # unbounded 100 s faster than two equal arms, 5 s noise: both rules give the same tiers in every draw
    import json
    import runpy
    import sys
    from pathlib import Path
    by_seed = {"unbounded-kv": [300, 310, 290, 305], "direct": [400, 412, 395, 401],
               "proxy-only": [405, 407, 391, 404]}
    (tmp_path / "results.json").write_text(json.dumps(
        {"metrics_by_seed": {a: [{"makespan_s": float(x)} for x in xs] for a, xs in by_seed.items()}}))
    script = Path(__file__).resolve().parent.parent / "scripts" / "rank_stability.py"
    monkeypatch.setattr(sys, "argv", [str(script), str(tmp_path), "--runs", "20"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(script), run_name="__main__")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "3 arms x 4 seeds" in out
    assert out.count("identical tiers 100%, no pair ordered oppositely 100%") == 2
