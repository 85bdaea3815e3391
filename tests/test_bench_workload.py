"""The bench workload generator (pure): plans are deterministic, closed-loop prompts extend the previous prompt
+ output, and with the simulator's byte model the text round-trips to the cached token ids."""

import random

import pytest

from kvgate.bench.workload import (DEFAULT_AGENTIC, SessionPlan, TurnPlan, ideal_prefill_agentic,
                                   ideal_prefill_mooncake, next_prompt, plan_agentic, plan_mooncake, plan_summary,
                                   quantile, sample)
from kvgate.sim.scheduler import TokenModel
from kvgate.sim.tokenizer import decode, encode
from kvgate.bench.trace import TraceRecord

SMALL = {"groups": 2, "group_size": 3, "task_prompt_tokens": {"dist": "const", "value": 50},
         "turns": {"dist": "const", "value": 4}, "observation_tokens": {"dist": "const", "value": 7},
         "output_tokens": {"dist": "const", "value": 5}, "tool_gap_s": {"dist": "const", "value": 2.5}}


def test_plan_is_deterministic_and_seed_dependent():
    assert plan_agentic(DEFAULT_AGENTIC, 3) == plan_agentic(DEFAULT_AGENTIC, 3)
    assert plan_agentic(DEFAULT_AGENTIC, 3) != plan_agentic(DEFAULT_AGENTIC, 4)


def test_groups_share_the_task_prompt_and_diverge_after_it():
    plans = plan_agentic(SMALL, 0)
    assert len(plans) == 6
    g0 = [p for p in plans if p.group == 0]
    g1 = [p for p in plans if p.group == 1]
    assert {p.first_prompt[:50] for p in g0} == {g0[0].first_prompt[:50]}
    assert g0[0].first_prompt[:50] != g1[0].first_prompt[:50]
    assert len({p.first_prompt for p in g0}) == 3          # the per-sample line differs
    assert [p.first_prompt[50:] for p in g0] == ["\n[sample 0]\n", "\n[sample 1]\n", "\n[sample 2]\n"]
    for p in plans:
        assert [t.max_tokens for t in p.turns] == [5, 5, 5, 5]
        assert [t.gap_s for t in p.turns] == [2.5, 2.5, 2.5, 0.0]     # no tool after the last turn
        assert [len(t.observation) for t in p.turns] == [7, 7, 7, 0]


def test_closed_loop_prompt_extends_previous_prompt_and_output_through_the_byte_model():
    """Run the plan against the simulator's token model offline: every turn's token ids start with the previous
    turn's prompt ids + output ids, i.e. what a client sending input_ids would send."""
    model = TokenModel()          # the default byte model
    plan = plan_agentic(SMALL, 1)[0]
    prompt = plan.first_prompt
    prev_ids = None
    for k, turn in enumerate(plan.turns):
        ids = encode(prompt)
        assert len(ids) == len(prompt)        # one token per ASCII character
        if prev_ids is not None:
            assert ids[:len(prev_ids)] == prev_ids
            assert len(ids) == len(prev_ids) + len(plan.turns[k - 1].observation)
        out_ids = model.generate(ids, turn.max_tokens)
        out_text = decode(out_ids)
        assert encode(out_text) == out_ids    # the byte model's text re-tokenizes exactly
        prev_ids = ids + out_ids
        prompt = next_prompt(prompt, out_text, turn.observation)
    assert len(prompt) == 50 + len("\n[sample 0]\n") + 4 * 5 + 3 * 7


def test_wide_model_output_does_not_round_trip():
    ids = TokenModel(vocab="wide").generate(encode("hello"), 20)
    assert encode(decode(ids)) != ids


def test_quantile_table_interpolates_in_log_space():
    pts = [[0.0, 1.0], [0.1, 1.6], [0.5, 2.5], [0.9, 7.8], [0.99, 60.0], [1.0, 180.0]]
    assert quantile(pts, 0.5) == pytest.approx(2.5)
    assert quantile(pts, 0.1) == pytest.approx(1.6)
    assert quantile(pts, 0.9) == pytest.approx(7.8)
    assert quantile(pts, 0.3) == pytest.approx((1.6 * 2.5) ** 0.5)   # halfway in log space = geometric mean
    rng = random.Random(0)
    xs = sorted(sample({"dist": "quantiles", "points": pts}, rng) for _ in range(20000))
    assert xs[2000] == pytest.approx(1.6, rel=0.05)
    assert xs[10000] == pytest.approx(2.5, rel=0.05)
    assert xs[18000] == pytest.approx(7.8, rel=0.08)
    with pytest.raises(ValueError):
        quantile([[0.1, 1.0], [1.0, 2.0]], 0.5)


def test_default_turns_average_about_eleven():
    plans = plan_agentic({**DEFAULT_AGENTIC, "groups": 50, "group_size": 8}, 0)
    assert 10.0 <= plan_summary(plans)["turns_mean"] <= 12.0


def test_ideal_prefill_counts_task_once_per_group_and_each_observation():
    plans = plan_agentic(SMALL, 0)
    # per group: task 50 once; each of 3 sessions its 12-char sample line; 3 observations x 7 per session
    assert ideal_prefill_agentic(plans) == 2 * (50 + 3 * 12 + 3 * 21)
    hand = [SessionPlan("a", 0, 0, 0, 10, "x" * 12, (TurnPlan(4, 1.0, "yy"), TurnPlan(4, 0.0, "")))]
    assert ideal_prefill_agentic(hand) == 12 + 2


def test_mooncake_plan_and_ideal_prefill():
    recs = [TraceRecord(1000, 1100, 10, (1, 2, 3)), TraceRecord(1500, 1600, 20, (1, 2, 3, 4)),
            TraceRecord(2500, 600, 5, (9, 10))]
    reqs = plan_mooncake(recs)
    assert [r.t_s for r in reqs] == [0.0, 0.5, 1.5]
    assert [len(r.prompt) for r in reqs] == [1100, 1600, 600]
    assert reqs[0].session_id == reqs[1].session_id and [r.turn for r in reqs[:2]] == [1, 2]
    assert reqs[1].prompt[:1024] == reqs[0].prompt[:1024]
    # 1100 new; then 1600 - 2 seen full blocks x 512; then 600 new
    assert ideal_prefill_mooncake(recs) == 1100 + (1600 - 1024) + 600
