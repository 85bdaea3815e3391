"""Replicate statistics and tiered ranking of bench arms (pure, kvgate.bench.ranking)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.bench.ranking import block_hsd, kendall_tau, mean_ci, paired_diff, same_ranking, t975, tier_text, tiers


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


def test_paired_difference_removes_the_workload_effect():
    # seeds differ a lot (300 vs 400 s) but b is always 10 s slower than a: the pairing sees exactly 10 +- 0
    a = [300.0, 400.0, 350.0]
    b = [310.0, 410.0, 360.0]
    assert paired_diff(b, a) == (10.0, 0.0)
    with pytest.raises(ValueError):
        paired_diff([1.0], [1.0, 2.0])


def test_block_hsd_hand_computed():
    # two arms, three seeds: the block design reduces to the paired difference d = b - a = 1, 3, 2
    # (mean 2, sd 1). Residuals of the additive model are -/+ (d_j - 2) / 2 -> SS = 2 x (1 + 1 + 0) / 4 = 1,
    # df = (2-1)(3-1) = 2, MSE = 0.5; HSD = q(0.95; 2, 2) x sqrt(0.5 / 3), and q(2, df) = sqrt(2) x t(df)
    # so HSD = t975(2) x sqrt(1 / 3) = the paired t half-width.
    hsd, df = block_hsd({"a": [10.0, 20.0, 30.0], "b": [11.0, 23.0, 32.0]})
    assert df == 2
    assert hsd == pytest.approx(paired_diff([11.0, 23.0, 32.0], [10.0, 20.0, 30.0])[1], rel=1e-3)
    assert block_hsd({"a": [1.0], "b": [2.0]}) == (None, 0)
    assert block_hsd({"a": [1.0, 2.0]}) == (None, 0)
    with pytest.raises(ValueError):
        block_hsd({"a": [1.0, 2.0], "b": [1.0]})


def test_tiers_group_what_the_seeds_cannot_separate():
    samples = {
        "unbounded-kv": [300.0, 280.0, 320.0],
        "direct": [340.0, 318.0, 362.0],         # +40, +38, +42 over unbounded: separated
        "proxy-only": [335.0, 325.0, 355.0],     # vs direct: -5, +7, -7: noise -> same tier as direct
        "admission": [380.0, 360.0, 400.0],      # +40 over proxy-only in every seed: separated
    }
    ts = tiers(samples)
    assert ts == [["unbounded-kv"], ["proxy-only", "direct"], ["admission"]]
    assert tier_text(ts) == "unbounded-kv < {proxy-only, direct} < admission"


def test_one_replicate_is_the_plain_order_and_failed_arms_come_last():
    ts = tiers({"a": [3.0], "b": [1.0], "c": [2.0], "bad": [0.5]}, failed=["bad"])
    assert ts == [["b"], ["c"], ["a"], ["bad"]]


def test_same_ranking_ignores_order_inside_a_tier_and_arms_only_one_run_has():
    a = [["u"], ["d", "p"], ["x"]]
    assert same_ranking(a, [["u"], ["p", "d"], ["x"]])
    assert same_ranking(a, [["u"], ["p", "d"], ["x"], ["extra"]])
    assert not same_ranking(a, [["u"], ["p"], ["d"], ["x"]])      # a tie split
    assert not same_ranking(a, [["d", "p"], ["u"], ["x"]])        # tiers swapped


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
