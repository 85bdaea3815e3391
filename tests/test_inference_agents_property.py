"""Prefix inference over random agent shapes, as OpenAI-compatible agent SDKs send them (hypothesis).

Each agent is a chat with ``tools`` and no session id; its turns interleave with the other agents'. On each turn
the model answers with text or with tool calls (SGLang's shape: ``content`` null, an ``index`` on each call),
and the agent then
  keeps    the answer (echoed as SDKs echo it: ``index`` dropped, ``content`` null, "" or absent, the arguments
           re-serialised) and appends the tool results or a user message;
  drops    an answer it cannot parse and asks again with feedback (the next prompt extends the previous
           prompt, not its answer);
  retries  the same request after giving up on the first attempt (a timeout: the turn never completed).
Some agents are GRPO siblings sharing one task prompt. What must hold, whatever the shape:
  - no inferred session ever holds two agents (siblings stay apart);
  - an agent with a task of its own is one session over all its completed turns (a first turn given up on
    before it completed leaves a session of its own: nothing tells its retry from a sibling's first turn).
Units go through the proxy's own functions (request_units / response_units), as kvgate feeds them.
"""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.sessions.inference import SessionInference, request_units, response_units

ROUTE = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]


def _answer(rng: random.Random, agent: int, turn: int) -> dict:
    if rng.random() < 0.5:
        return {"role": "assistant", "content": f"agent {agent} turn {turn}: {rng.getrandbits(64):x} " * 3}
    calls = [{"id": f"call_{rng.getrandbits(40):x}", "index": i, "type": "function",
              "function": {"name": rng.choice(["run", "read", "grep"]),
                           "arguments": json.dumps({"cmd": f"ls {rng.getrandbits(32):x}", "n": i})}}
             for i in range(rng.randint(1, 2))]
    return {"role": "assistant", "content": None, "tool_calls": calls,
            "reasoning_content": "hidden " * rng.randint(0, 3)}


def _echo(rng: random.Random, answer: dict) -> dict:
    """The answer as an SDK sends it back: no index, content null / "" / absent, arguments re-serialised."""
    msg: dict = {"role": "assistant"}
    if answer.get("tool_calls"):
        style = rng.randrange(3)
        if style == 0:
            msg["content"] = None
        elif style == 1:
            msg["content"] = ""
        msg["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": json.dumps(json.loads(c["function"]["arguments"]),
                                                                   separators=(",", ":"), sort_keys=True)}}
                             for c in answer["tool_calls"]]
    else:
        msg["content"] = answer["content"] if rng.random() < 0.5 else [{"type": "text", "text": answer["content"]}]
    return msg


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_agents=st.integers(1, 6), n_tasks=st.integers(1, 6),
       turns=st.integers(2, 7), p_drop=st.sampled_from([0.0, 0.3, 0.6]), p_retry=st.sampled_from([0.0, 0.2]))
def test_each_agent_is_one_session_and_siblings_stay_apart(seed, n_agents, n_tasks, turns, p_drop, p_retry):
    rng = random.Random(seed)
    inf = SessionInference()
    system = {"role": "system", "content": "You are a coding agent with tools. " * 12}
    task_of = [rng.randrange(n_tasks) for _ in range(n_agents)]
    msgs = [[system, {"role": "user", "content": f"Task {t}: " + "fix the bug in module X. " * 6}] for t in task_of]
    sessions: list[list[str]] = [[] for _ in range(n_agents)]  # the session of each completed turn
    attempts: list[list[str]] = [[] for _ in range(n_agents)]  # and of each attempt given up on
    left = {a: turns for a in range(n_agents)}
    clock = 0.0
    while left:
        a = rng.choice(sorted(left))  # the agents' turns interleave
        clock += 1.0
        body = {"model": "m", "messages": msgs[a], "tools": TOOLS}
        units = request_units(ROUTE, body)
        if rng.random() < p_retry:  # a first attempt the client gives up on (never completes)
            r = inf.infer(units, clock)
            inf.on_request_start(r.session_id, units, clock, r.prepared)
            inf.on_request_end(r.session_id, clock, completed=False)
            attempts[a].append(r.session_id)
        r = inf.infer(units, clock)
        inf.on_request_start(r.session_id, units, clock, r.prepared)
        answer = _answer(rng, a, turns - left[a])
        out = response_units(ROUTE, {"choices": [{"message": answer}]}, True)
        inf.on_response(r.session_id, out, clock + 0.5)
        inf.on_request_end(r.session_id, clock + 0.5, completed=True)
        sessions[a].append(r.session_id)
        if rng.random() < p_drop:  # an answer it cannot parse: dropped, and asked again with feedback
            msgs[a] = msgs[a] + [{"role": "user", "content": f"Your reply could not be parsed ({rng.getrandbits(16)})."
                                                            " Answer again with valid JSON."}]
        else:
            msgs[a] = msgs[a] + [_echo(rng, answer)]
            for c in answer.get("tool_calls") or ():
                msgs[a].append({"role": "tool", "tool_call_id": c["id"], "content": f"out {rng.getrandbits(24)}"})
            if not answer.get("tool_calls"):
                msgs[a].append({"role": "user", "content": "Go on."})
        left[a] -= 1
        if not left[a]:
            del left[a]
    owner: dict[str, int] = {}
    for a, sids in enumerate(sessions):
        for sid in sids + attempts[a]:
            assert owner.setdefault(sid, a) == a, f"session {sid} holds agents {owner[sid]} and {a}"
    for a, sids in enumerate(sessions):
        if task_of.count(task_of[a]) == 1:  # a task of its own: nothing to confuse it with
            assert len(set(sids)) == 1, (a, sids, inf.stats())


def test_tool_calling_agent_that_drops_and_reasks_is_one_session_by_reason():
    """The measured case: 4 agents x 6 calls with tools, each answer dropped and asked again once, then kept."""
    rng = random.Random(3)
    inf = SessionInference()
    reasons = []
    for agent in range(4):
        msgs = [{"role": "system", "content": f"Agent {agent}. " * 80}, {"role": "user", "content": "Plan it."}]
        for turn in range(6):
            units = request_units(ROUTE, {"messages": msgs, "tools": TOOLS})
            r = inf.infer(units, turn)
            reasons.append(r.reason)
            inf.on_request_start(r.session_id, units, turn, r.prepared)
            ans = _answer(rng, agent, turn)
            inf.on_response(r.session_id, response_units(ROUTE, {"choices": [{"message": ans}]}, True), turn)
            inf.on_request_end(r.session_id, turn)
            if turn % 2 == 0:
                msgs = msgs + [{"role": "user", "content": "Could not parse that; try again."}]
            else:
                msgs = msgs + [_echo(rng, ans), {"role": "user", "content": "ok"}]
    assert reasons.count("new") == 4 and reasons.count("reask") == 12 and reasons.count("decisive") == 8
    assert len(inf) == 4
