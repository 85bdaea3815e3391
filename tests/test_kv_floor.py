"""scripts/kv_floor.py: the least recompute a KV-bounded policy needs on a run's own timeline.

An example worked by hand, properties over random timelines (the floor is what dropping must cost at every
moment and no more than dropping every gap, falls as the pool grows, and is 0 once the pool holds the peak), and
the command on a results file as `kvgate bench` writes it.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings, strategies as st

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "kv_floor.py"
_spec = importlib.util.spec_from_file_location("kv_floor", SCRIPT)
kv_floor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kv_floor)


def turn(session, k, start, ttft, end, prompt, output):
    return {"session": session, "turn": k, "start": start, "ttft": ttft, "end": end, "ok": True,
            "prompt_tokens": prompt, "output_tokens": output}


def two_programs():
    """Two one-session groups, each: a turn of 40 prompt + 20 output tokens (first token at 0.5, end 1), a tool
    call, a turn of 100 (first token at 5, end 6). Between the turns each holds 20 tokens beyond its first
    prompt (its group's shared prompt, resident only while it is in a turn)."""
    out = []
    for g in (0, 1):
        sid = f"st0-g{g}-s0"
        out += [turn(sid, 1, 0.0, 0.5, 1.0, 40, 20), turn(sid, 2, 4.0, 5.0, 6.0, 100, 10)]
    return out


def test_two_programs_over_a_tool_call_worked_by_hand():
    resident, gaps, peak = kv_floor.timeline(two_programs())
    assert sorted(gaps) == [(1.0, 5.0, 20), (1.0, 5.0, 20)]
    assert peak == 2 * (40 + 60)  # both second turns: the shared 40 and their own 60
    for pool, want in ((0, 40), (10, 30), (30, 10), (40, 0), (1000, 0)):
        assert kv_floor.floor(resident, gaps, pool)[0] == want


def test_a_resident_span_starting_inside_a_gap_is_counted_against_it():
    """A third program's turn (first token at 2, inside the others' tool calls) takes the pool's room there."""
    reqs = two_programs() + [turn("st0-g2-s0", 1, 1.5, 2.0, 3.0, 25, 5)]
    resident, gaps, _ = kv_floor.timeline(reqs)
    assert kv_floor.floor(resident, gaps, 40)[0] == 25  # 40 of room less its 25, against 40 of gaps


SESSION = st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 2.0), st.floats(0.1, 3.0), st.integers(0, 400),
                             st.integers(0, 100)), min_size=1, max_size=5)


def records(sessions):
    """Each session's turns one after another: (gap before it, queue, turn length, prompt growth, output)."""
    out = []
    for i, turns in enumerate(sessions):
        t, prompt = 0.0, 50
        for k, (gap, queue, length, grow, output) in enumerate(turns):
            start = t + gap
            out.append(turn(f"st0-g{i % 3}-s{i}", k + 1, start, start + queue, start + queue + length,
                            prompt, output))
            t = start + queue + length
            prompt += output + grow
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(SESSION, min_size=1, max_size=6), st.integers(0, 3000), st.integers(0, 3000))
def test_the_floor_is_what_dropping_must_cost_at_every_moment_and_falls_as_the_pool_grows(sessions, a, b):
    resident, gaps, peak = kv_floor.timeline(records(sessions))
    small, large = sorted((a, b))
    f_small, f_large = kv_floor.floor(resident, gaps, small)[0], kv_floor.floor(resident, gaps, large)[0]
    assert 0 <= f_large <= f_small + 1 <= sum(c for _, _, c in gaps) + 1  # +1: the LP's rounding
    assert kv_floor.floor(resident, gaps, peak)[0] <= 1
    for t in sorted({s for s, _, _ in resident + gaps}):
        must = sum(c for s, e, c in resident if s <= t < e)
        open_ = sum(c for s, e, c in gaps if s <= t < e)
        assert f_small >= open_ - max(0, small - must) - 1


def test_the_command_reads_a_bench_results_file(tmp_path):
    res = {"scenario": {"engines": 1, "max_total_num_tokens": 30, "sim_extra": {"prefill_tokens_per_s": 10}},
           "seeds": [7], "metrics_by_seed": {"unbounded-kv": [{"recomputed_prefill_tokens": 3}]},
           "arms": {"unbounded-kv": [{"requests": two_programs()}]}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(res))
    r = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    row = r.stdout.strip().splitlines()[-1].split()
    assert row[0] == "7" and row[1] == "200" and row[4] == "10" and row[5] == "1.0" and row[6] == "3"
    res["arms"] = {"unbounded-kv": None}
    path.write_text(json.dumps(res))
    r = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no raw records of arm 'unbounded-kv'" in r.stderr


def _greedy_cost(resident, gaps, pool):
    """The recompute of one feasible policy: keep each gap (largest first) while the pool holds, at every moment
    of it, what must be resident and the gaps kept so far; the rest are dropped. The floor can be no higher."""
    points = sorted({s for s, _, _ in resident + gaps})

    def load(t, kept):
        return (sum(c for s, e, c in resident if s <= t < e) + sum(c for s, e, c in kept if s <= t < e))

    kept, cost = [], 0
    for g in sorted(gaps, key=lambda g: -g[2]):
        s, e, c = g
        if all(load(t, kept + [g]) <= max(pool, load(t, [])) for t in points if s <= t < e):
            kept.append(g)
        else:
            cost += c
    return cost


@settings(max_examples=150, deadline=None)
@given(st.lists(SESSION, min_size=1, max_size=6), st.integers(0, 3000))
def test_the_floor_is_no_more_than_what_a_feasible_policy_recomputes(sessions, pool):
    """A lower bound must not overstate: the floor is at most the recompute of a policy that keeps some gaps
    whole within the pool (where what must be resident alone exceeds the pool, nothing more is kept there)."""
    resident, gaps, _ = kv_floor.timeline(records(sessions))
    assert kv_floor.floor(resident, gaps, pool)[0] <= _greedy_cost(resident, gaps, pool) + 1


def test_a_turn_without_a_first_token_is_resident_from_its_end_only():
    """No token streamed (no ttft): the turn demands nothing before its end, and the gap before it lasts until
    then (what it holds may be kept or dropped): never more demand than the run's."""
    reqs = two_programs()
    reqs[1]["ttft"] = None
    resident, gaps, _ = kv_floor.timeline(reqs)
    assert (1.0, 6.0, 20) in gaps and (6.0, 6.0, 60) in resident
