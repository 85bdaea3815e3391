"""Prefix-based session inference (kvgate.sessions.inference), driven by hand with synthetic agents.

Numbers, not status codes: which session id each request gets, the counters, pairwise precision/recall.
Timing is not asserted here (scripts/bench_inference.py shows the 1 ms figure).
"""

from __future__ import annotations

import random
import tracemalloc

import pytest

from kvgate.sessions.inference import SessionInference, chat_output_text, chat_to_text, score


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 151_000) for _ in range(n)]


class Agent:
    """A client that sends its whole context each turn and never names its session."""

    def __init__(self, inf: SessionInference, ctx):
        self.inf, self.ctx, self.sids, self.results = inf, ctx, [], []

    def start(self, now: float = 0.0):
        r = self.inf.infer(self.ctx, now)
        self.results.append(r)
        self.sids.append(r.session_id)
        self.inf.on_request_start(r.session_id, self.ctx, now, r.prepared)
        return r

    def finish(self, output, new_units, now: float = 0.0, seen=None):
        """The engine answered ``output``; kvgate relayed ``seen`` (default: output); the agent appends
        ``output`` + ``new_units`` to its context."""
        sid = self.sids[-1]
        self.inf.on_response(sid, output if seen is None else seen, now)
        self.inf.on_request_end(sid, now)
        self.ctx = self.ctx + output + new_units


def test_fifty_turn_session_stays_one():
    rng = random.Random(1)
    inf = SessionInference()
    a = Agent(inf, ids(rng, 1500))
    explained = []  # previous prompt + previous output, per turn
    for turn in range(50):
        a.start(now=turn)
        out = ids(rng, rng.randrange(20, 600))
        explained.append(len(a.ctx) + len(out))
        a.finish(out, ids(rng, rng.randrange(5, 300)), now=turn + 0.5)
    assert len(set(a.sids)) == 1
    assert a.results[0].reason == "new"
    assert [r.reason for r in a.results[1:]] == ["decisive"] * 49
    assert [r.matched_tokens for r in a.results[1:]] == explained[:-1]
    assert inf.stats()["tracked"] == 1 and inf.stats()["index_keys"] == 1


def test_matched_tokens_is_previous_prompt_plus_output():
    rng = random.Random(2)
    inf = SessionInference()
    a = Agent(inf, ids(rng, 1000))
    a.start()
    a.finish(ids(rng, 300), ids(rng, 50))
    r = a.start()
    assert r.decisive and r.matched_tokens == 1300 and r.candidates == 1


@pytest.mark.parametrize("concurrent_first_turn", [True, False])
def test_grpo_siblings_sharing_a_long_prompt_stay_apart(concurrent_first_turn):
    rng = random.Random(3)
    inf = SessionInference()
    task = ids(rng, 8000)  # a long shared task prompt (125 blocks)
    opening = ids(rng, 200)  # every sibling's first output opens with the same 200 ids, then diverges
    agents = [Agent(inf, list(task)) for _ in range(8)]
    if concurrent_first_turn:
        for a in agents:
            a.start()
        for a in agents:
            a.finish(opening + ids(rng, 400), ids(rng, 100))
    else:
        for a in agents:
            a.start()
            a.finish(opening + ids(rng, 400), ids(rng, 100))
    order = [a for a in agents for _ in range(6)]
    rng.shuffle(order)
    for a in order:
        a.start()
        a.finish(ids(rng, rng.randrange(10, 400)), ids(rng, 40))
    assert len({a.sids[0] for a in agents}) == 8
    for a in agents:
        assert len(set(a.sids)) == 1
    pred = [sid for a in agents for sid in a.sids]
    truth = [i for i, a in enumerate(agents) for _ in a.sids]
    assert score(pred, truth) == (1.0, 1.0)
    assert inf.stats()["ambiguous"] == 0
    assert inf.stats()["diverged"] > 0  # the other siblings were considered and excluded


def test_sibling_with_unobserved_output_links_by_prompt_only_when_unique():
    rng = random.Random(4)
    inf = SessionInference()
    task = ids(rng, 640)
    a, b = Agent(inf, list(task)), Agent(inf, list(task))
    a.start(), b.start()
    a.finish(ids(rng, 200), ids(rng, 10))
    # b's response was not observed (say the stream was cut): its output is unknown
    out_b = ids(rng, 200)
    inf.on_request_end(b.sids[-1], 0.0)
    b.ctx = b.ctx + out_b + ids(rng, 10)
    r = b.start()
    assert r.session_id == b.sids[0] and r.reason == "prompt-only" and not r.decisive  # a diverged, excluded
    r = a.start()
    assert r.session_id == a.sids[0] and r.decisive


def test_prompt_only_tie_starts_a_new_session_and_counts():
    rng = random.Random(5)
    inf = SessionInference()
    task = ids(rng, 640)
    a, b = Agent(inf, list(task)), Agent(inf, list(task))
    a.start(), b.start()
    for ag in (a, b):  # neither output observed
        inf.on_request_end(ag.sids[-1], 0.0)
    r = inf.infer(task + ids(rng, 300), 1.0)
    assert r.reason == "new-ambiguous" and r.session_id not in (a.sids[0], b.sids[0])
    assert inf.stats()["ambiguous"] == 1


def test_contexts_identical_by_chance_are_not_merged_and_are_counted():
    rng = random.Random(6)
    inf = SessionInference()
    task = ids(rng, 700)
    same_output = ids(rng, 250)  # temperature 0: both siblings answer the same
    a, b = Agent(inf, list(task)), Agent(inf, list(task))
    a.start(), b.start()
    a.finish(same_output, [])
    b.finish(same_output, [])
    assert a.ctx == b.ctx
    nxt = a.ctx + ids(rng, 80)
    r = inf.infer(nxt, 1.0)
    assert r.reason == "new-ambiguous" and not r.decisive
    assert r.session_id not in (a.sids[0], b.sids[0])
    assert r.matched_tokens == 950 and r.candidates == 2
    assert inf.stats()["ambiguous"] == 1
    # the new session then continues on its own
    inf.on_request_start(r.session_id, nxt, 1.0, r.prepared)
    out = ids(rng, 100)
    inf.on_response(r.session_id, out, 2.0)
    inf.on_request_end(r.session_id, 2.0)
    r2 = inf.infer(nxt + out + ids(rng, 5), 3.0)
    assert r2.session_id == r.session_id and r2.decisive


def test_session_with_request_in_flight_is_not_a_candidate_unless_parallel_allowed():
    rng = random.Random(7)
    for parallel, expect_same in ((False, False), (True, True)):
        inf = SessionInference(allow_parallel=parallel)
        p = ids(rng, 500)
        r = inf.infer(p, 0)
        inf.on_request_start(r.session_id, p, 0, r.prepared)
        r2 = inf.infer(p + ids(rng, 100), 0.1)  # the first is still in flight
        assert (r2.session_id == r.session_id) is expect_same
        assert inf.stats()["busy_skipped"] == (0 if parallel else 1)


def test_equal_prompt_is_not_a_continuation():
    rng = random.Random(8)
    inf = SessionInference()
    p = ids(rng, 500)
    r = inf.infer(p, 0)
    inf.on_request_start(r.session_id, p, 0, r.prepared)
    inf.on_response(r.session_id, ids(rng, 40), 0)
    inf.on_request_end(r.session_id, 0)
    assert inf.infer(p, 1).reason == "new"  # a retry or a sibling: same prompt, nothing appended


def test_partial_output_links_when_the_template_drops_the_stop_token():
    rng = random.Random(9)
    inf = SessionInference()
    a = Agent(inf, ids(rng, 900))
    a.start()
    out = ids(rng, 700) + [151_645]  # ends with a stop token the client does not keep
    a.finish(out[:-1], [151_644] + ids(rng, 60), seen=out)
    r = a.start()
    assert r.session_id == a.sids[0] and r.reason == "partial" and not r.decisive
    assert 900 + 0.5 * 701 <= r.matched_tokens <= 900 + 700


def test_output_diverging_early_without_tail_evidence_does_not_link():
    rng = random.Random(10)
    inf = SessionInference(probe_tokens=0)
    a = Agent(inf, ids(rng, 900))
    a.start()
    out = ids(rng, 700)
    a.finish(out[:100] + ids(rng, 600), ids(rng, 60), seen=out)  # only 1/7 of the relayed output is in R
    r = a.start()
    assert r.reason == "new"
    assert inf.stats()["diverged"] == 1


def test_rerendered_chat_template_dropping_reasoning_still_links():
    inf = SessionInference()
    system = {"role": "system", "content": "You are a careful agent. " * 40}  # ~1000 characters
    rng = random.Random(11)
    convs = []
    for s in range(4):  # GRPO siblings: same task
        convs.append([system, {"role": "user", "content": "Task: fix the failing test in repo X. " * 5}])
    sids: list[list[str]] = [[] for _ in convs]
    for turn in range(6):
        for s, msgs in enumerate(convs):
            prompt = chat_to_text(msgs)
            r = inf.infer(prompt, turn)
            sids[s].append(r.session_id)
            inf.on_request_start(r.session_id, prompt, turn, r.prepared)
            reasoning = "<think>" + "".join(rng.choice("abcdefgh ") for _ in range(600)) + "</think>\n\n"
            answer = f"Sibling {s} turn {turn}: run `pytest -k case{rng.randrange(10**6)}` and read the log."
            relayed = {"role": "assistant", "content": reasoning + answer}  # no reasoning parser
            inf.on_response(r.session_id, chat_output_text(relayed), turn + 0.5)
            inf.on_request_end(r.session_id, turn + 0.5)
            # the client's template keeps only the answer of earlier turns
            msgs += [{"role": "assistant", "content": answer},
                     {"role": "tool", "tool_call_id": f"c{turn}", "content": "ok " * rng.randrange(5, 50)}]
    for s in range(4):
        assert len(set(sids[s])) == 1, sids[s]
    assert len({x[0] for x in sids}) == 4
    assert inf.stats()["rerender"] == 4 * 5 and inf.stats()["ambiguous"] == 0


def test_chat_with_reasoning_parser_is_decisive():
    inf = SessionInference()
    msgs = [{"role": "system", "content": "s" * 600}, {"role": "user", "content": "hi"}]
    r = inf.infer(chat_to_text(msgs), 0)
    inf.on_request_start(r.session_id, chat_to_text(msgs), 0, r.prepared)
    answer = {"role": "assistant", "content": "Calling the tool.", "reasoning_content": "hidden",
              "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}
    inf.on_response(r.session_id, chat_output_text(answer), 1)
    inf.on_request_end(r.session_id, 1)
    echoed = {"role": "assistant", "content": "Calling the tool.",  # the client drops reasoning_content
              "tool_calls": [{"type": "function", "id": "c1", "function": {"arguments": "{}", "name": "ls"}}]}
    msgs += [echoed, {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"}]
    r2 = inf.infer(chat_to_text(msgs), 2)
    assert r2.session_id == r.session_id and r2.decisive


def test_chat_to_text_prefix_property_and_rejects_odd_input():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url"}]}]
    out = {"role": "assistant", "content": "seen"}
    p = chat_to_text(msgs)
    nxt = chat_to_text(msgs + [out, {"role": "user", "content": "next"}])
    assert nxt.startswith(p + chat_output_text(out))
    assert "[image_url]" in p
    assert chat_to_text("not a list") is None and chat_to_text([1, 2]) is None
    assert chat_output_text(None) == ""


def test_text_prompts_work_like_ids():
    rng = random.Random(12)
    inf = SessionInference()
    text = "".join(rng.choice("abcdefghij \n") for _ in range(3000))
    a = Agent(inf, text)
    for turn in range(10):
        a.start(turn)
        a.finish("".join(rng.choice("xyz ") for _ in range(rng.randrange(50, 900))), "\nobs: ok\n", turn)
    assert len(set(a.sids)) == 1 and all(r.decisive for r in a.results[1:])


def test_tokens_and_text_never_match_each_other():
    inf = SessionInference(block_chars=64)
    p = list(range(1000, 1200))
    r = inf.infer(p, 0)
    inf.on_request_start(r.session_id, p, 0, r.prepared)
    inf.on_request_end(r.session_id, 0)
    assert inf.infer("x" * 500, 1).reason == "new"


def test_short_prompts_are_not_indexed():
    inf = SessionInference()
    p = list(range(1000, 1040))  # < one 64-id block
    r = inf.infer(p, 0)
    inf.on_request_start(r.session_id, p, 0, r.prepared)
    inf.on_response(r.session_id, list(range(5000, 5100)), 0)
    inf.on_request_end(r.session_id, 0)
    assert inf.stats()["index_keys"] == 0
    assert inf.infer(p + list(range(5000, 5100)) + [7], 1).reason == "new"


def test_output_of_a_prompt_shorter_than_a_block_still_aligns():
    inf = SessionInference(block_tokens=4)
    p = [10, 11, 12, 13, 14, 15]  # one full block + 2
    r = inf.infer(p, 0)
    inf.on_request_start(r.session_id, p, 0, r.prepared)
    inf.on_response(r.session_id, [20, 21, 22, 23, 24], 0)
    inf.on_request_end(r.session_id, 0)
    r2 = inf.infer(p + [20, 21, 22, 23, 24, 30], 1)
    assert r2.session_id == r.session_id and r2.decisive and r2.matched_tokens == 11


def test_unsupported_inputs_are_not_inferred():
    inf = SessionInference()
    for bad in ([], "", [[1, 2], [3, 4]], [True, False], {"a": 1}, None, [{"x": 1}]):
        assert inf.infer(bad, 0).session_id is None
    assert inf.stats()["unsupported"] == 7
    inf.on_request_start("s", [[1]], 0)  # never raises; the session is tracked, not indexed
    inf.on_response("s", [1, 2], 0)
    inf.on_request_end("s", 0)
    assert "s" in inf and inf.stats()["index_keys"] == 0


def test_inferred_ids_are_opaque_and_distinct():
    inf = SessionInference()
    got = {inf.infer(list(range(i, i + 100)), 0).session_id for i in range(200)}
    assert len(got) == 200
    assert all(s.startswith("inf-") and len(s) == 4 + 16 for s in got)


def test_forget_removes_the_session_from_matching():
    rng = random.Random(13)
    inf = SessionInference()
    a = Agent(inf, ids(rng, 300))
    a.start()
    a.finish(ids(rng, 50), ids(rng, 5))
    assert inf.forget(a.sids[0]) and not inf.forget(a.sids[0])
    assert inf.infer(a.ctx, 1).reason == "new" and inf.stats()["index_keys"] == 0


def test_cap_drops_the_longest_idle_and_counts_it():
    inf = SessionInference(max_sessions=100)
    busy = list(range(10**6, 10**6 + 200))
    r = inf.infer(busy, 0)
    inf.on_request_start(r.session_id, busy, 0, r.prepared)  # in flight: never dropped
    for i in range(1000):
        p = list(range(i * 1000, i * 1000 + 130))
        x = inf.infer(p, i)
        inf.on_request_start(x.session_id, p, i, x.prepared)
        inf.on_request_end(x.session_id, i)
    st = inf.stats()
    assert st["tracked"] == 100 and st["dropped"] == 901 and st["index_keys"] == 100
    assert r.session_id in inf
    # the most recent sessions are the ones kept
    assert inf.infer(list(range(999_000, 999_130)) + [1], 2000).reason == "prompt-only"
    assert inf.infer(list(range(130)) + [1], 2000).reason == "new"


def test_memory_stays_under_its_cap_with_100000_sessions():
    """100,000 sessions (prompt 130 ids, output 100 ids) tracked: traced memory under 1 KiB per session
    (measured about 0.75 KiB), and sessions past the cap are dropped, not kept."""
    n = 100_000
    inf = SessionInference(max_sessions=n)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        body, tail = tuple(range(129)), tuple(range(100, 199))  # small ints: no per-id allocation to trace
        for i in range(n):
            p = (1000 + i,) + body  # distinct first block per session
            r = inf.infer(p, i)
            inf.on_request_start(r.session_id, p, i, r.prepared)
            inf.on_response(r.session_id, (i,) + tail, i)
            inf.on_request_end(r.session_id, i)
        del p, r
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(inf) == n
    assert used < n * 1024, f"{used / n:.0f} bytes per session"
    for i in range(n, n + 5000):  # past the cap
        p = tuple(range(1000 + 7 * i, 1000 + 7 * i + 130))
        r = inf.infer(p, i)
        inf.on_request_start(r.session_id, p, i, r.prepared)
        inf.on_request_end(r.session_id, i)
    st = inf.stats()
    assert st["tracked"] == n and st["dropped"] == 5000 and st["index_keys"] <= n


def test_64k_token_prompt_is_linked_correctly():
    """Correctness at the size the benchmark times (scripts/bench_inference.py shows the figure)."""
    rng = random.Random(14)
    inf = SessionInference()
    agents = [Agent(inf, ids(rng, 60_000)) for _ in range(2)]
    shared = ids(rng, 60_000)
    agents.append(Agent(inf, list(shared)))
    agents.append(Agent(inf, list(shared)))
    for a in agents:
        a.start()
        a.finish(ids(rng, 2000), ids(rng, 3000))
    for a in agents:
        assert len(a.ctx) == 65_000
        r = a.start(1)
        assert r.session_id == a.sids[0] and r.decisive and r.matched_tokens == 62_000


def test_random_interleaved_workload_is_exact():
    """Many GRPO groups, random interleaving, outputs sharing an opening within a group."""
    rng = random.Random(15)
    inf = SessionInference()
    live, pred, truth = [], [], []
    for g in range(12):
        task, opening = ids(rng, rng.randrange(100, 3000)), ids(rng, rng.randrange(0, 300))
        for s in range(rng.randrange(1, 9)):
            live.append({"truth": (g, s), "ctx": list(task), "opening": opening, "turns": 0,
                         "left": rng.randrange(1, 12), "busy": None})
    while live:
        a = rng.choice(live)
        if a["busy"] is None:
            r = inf.infer(a["ctx"], 0)
            pred.append(r.session_id)
            truth.append(a["truth"])
            inf.on_request_start(r.session_id, a["ctx"], 0, r.prepared)
            a["busy"] = r.session_id
        else:
            out = (a["opening"] if a["turns"] == 0 else []) + ids(rng, rng.randrange(1, 500))
            inf.on_response(a["busy"], out, 0)
            inf.on_request_end(a["busy"], 0)
            a["ctx"] = a["ctx"] + out + ids(rng, rng.randrange(1, 200))
            a["busy"] = None
            a["turns"] += 1
            a["left"] -= 1
            if a["left"] == 0:
                live.remove(a)
    assert score(pred, truth) == (1.0, 1.0)


# --- score ---------------------------------------------------------------------------------------

def test_score_hand_computed():
    # truth pairs: (0,1) (2,3) (2,4) (3,4) = 4; predicted pairs: (0,1) (0,2) (1,2) (3,4) = 4; correct: (0,1) (3,4)
    assert score(["a", "a", "a", "b", "b"], [1, 1, 2, 2, 2]) == (0.5, 0.5)
    # all merged: 10 predicted pairs, 4 true, 4 correct
    assert score(["x"] * 5, [1, 1, 2, 2, 2]) == (0.4, 1.0)
    # all split: no predicted pairs -> precision 1 (nothing merged wrongly), recall 0
    assert score(["a", "b", "c", "d", "e"], [1, 1, 2, 2, 2]) == (1.0, 0.0)
    # one sibling split off a 3-request session: predicted pairs (0,1); true (0,1) (0,2) (1,2)
    assert score(["p", "p", "q"], ["t", "t", "t"]) == (1.0, pytest.approx(1 / 3))
    assert score([], []) == (1.0, 1.0)
    with pytest.raises(ValueError):
        score(["a"], [])


# --- request/response extraction -----------------------------------------------------------------

def test_request_units_per_route():
    from kvgate.sessions.inference import request_units
    assert request_units("/generate", {"input_ids": [1, 2, 3]}) == [1, 2, 3]
    assert request_units("/generate", {"text": "hi"}) == "hi"
    assert request_units("/generate", {"input_ids": [[1], [2]]}) is None  # batch
    assert request_units("/generate", {"text": ["a", "b"]}) is None  # batch
    assert request_units("/generate", {"input_ids": [1], "sampling_params": {"n": 4}}) is None
    assert request_units("/generate", {"text": "x", "input_embeds": [[0.1]]}) is None
    assert request_units("/v1/completions", {"prompt": "p"}) == "p"
    assert request_units("/v1/completions", {"prompt": [5, 6]}) == [5, 6]
    assert request_units("/v1/completions", {"prompt": ["a", "b"]}) is None
    assert request_units("/v1/completions", {"prompt": "p", "n": 2}) is None
    msgs = [{"role": "user", "content": "q"}]
    assert request_units("/v1/chat/completions", {"messages": msgs}) == chat_to_text(msgs)
    assert request_units("/v1/responses", {"input": "x"}) is None


def test_response_units_per_route():
    from kvgate.sessions.inference import response_units
    gen = {"text": "ab", "output_ids": [7, 8], "meta_info": {}}
    assert response_units("/generate", gen, prompt_kind_text=False) == [7, 8]
    assert response_units("/generate", gen, prompt_kind_text=True) == "ab"
    assert response_units("/v1/completions", {"choices": [{"text": "t"}]}, True) == "t"
    msg = {"role": "assistant", "content": "c"}
    assert response_units("/v1/chat/completions", {"choices": [{"message": msg}]}, True) == chat_output_text(msg)
    assert response_units("/v1/chat/completions", {"choices": []}, True) is None
    assert response_units("/generate", [gen], False) is None


def test_abandoned_attempt_leaves_the_session_as_it_was_so_the_retry_extends_it():
    rng = random.Random(21)
    inf = SessionInference()
    p1, o1 = ids(rng, 1000), ids(rng, 1000)
    r1 = inf.infer(p1, 0)
    inf.on_request_start(r1.session_id, p1, 0, r1.prepared)
    inf.on_response(r1.session_id, o1, 1)
    inf.on_request_end(r1.session_id, 1)
    turn2 = p1 + o1 + ids(rng, 56)
    a = inf.infer(turn2, 2)
    assert a.session_id == r1.session_id and a.reason == "decisive"
    inf.on_request_start(a.session_id, turn2, 2, a.prepared)
    inf.on_request_end(a.session_id, 2.5, completed=False)  # the client timed out and left
    b = inf.infer(turn2, 3)  # the identical retry
    assert b.session_id == r1.session_id and b.reason == "decisive" and b.matched_tokens == 2000
    assert inf.stats()["abandoned"] == 1 and inf.stats()["index_keys"] == 1


def test_retry_while_the_abandoned_attempt_is_still_in_flight_links_to_it():
    rng = random.Random(22)
    inf = SessionInference()
    p1, o1 = ids(rng, 300), ids(rng, 100)
    r1 = inf.infer(p1, 0)
    inf.on_request_start(r1.session_id, p1, 0, r1.prepared)
    inf.on_response(r1.session_id, o1, 0)
    inf.on_request_end(r1.session_id, 0)
    turn2 = p1 + o1 + ids(rng, 10)
    a = inf.infer(turn2, 1)
    inf.on_request_start(a.session_id, turn2, 1, a.prepared)
    b = inf.infer(turn2, 1.5)  # kvgate has not seen attempt 1 end yet
    assert b.session_id == r1.session_id and b.reason == "retry"
    inf.on_request_start(b.session_id, turn2, 1.5, b.prepared)
    inf.on_request_end(a.session_id, 1.6, completed=False)  # attempt 1 ends: the retry still runs
    out2 = ids(rng, 50)
    inf.on_response(b.session_id, out2, 2)
    inf.on_request_end(b.session_id, 2)
    c = inf.infer(turn2 + out2 + [7], 3)
    assert c.session_id == r1.session_id and c.reason == "decisive" and inf.stats()["abandoned"] == 0


def test_identical_first_prompts_in_flight_are_siblings_not_retries():
    inf = SessionInference()
    p = list(range(5000, 5300))
    a = inf.infer(p, 0)
    inf.on_request_start(a.session_id, p, 0, a.prepared)
    b = inf.infer(p, 0)
    assert b.reason == "new" and b.session_id != a.session_id


def test_units_with_a_non_integer_anywhere_are_not_inferred_and_leave_nothing_behind():
    inf = SessionInference(max_sessions=10)
    for i in range(20):
        bad = list(range(i * 1000, i * 1000 + 64)) + [1.5]  # a float after the last full block
        r = inf.infer(bad, i)
        assert r.session_id is None and r.reason == "unsupported"
        inf.on_request_start(f"named-{i}", bad, i)  # a named session with such a prompt: no raise, no index
        inf.on_request_end(f"named-{i}", i, completed=True)
    for bad in ([1, 2, True], [1, [2]], [0.0] * 70):
        assert inf.infer(bad, 30).reason == "unsupported"
    st = inf.stats()
    assert st["index_keys"] == 0 and all(t.in_flight == 0 for t in inf._tracks.values())
    p = list(range(90_000, 90_200))
    r = inf.infer(p, 40)
    inf.on_request_start(r.session_id, p, 40, r.prepared)
    inf.on_response(r.session_id, [5] * 20, 41)
    inf.on_request_end(r.session_id, 41)
    assert inf.infer(p + [5] * 20 + [1], 42).session_id == r.session_id
