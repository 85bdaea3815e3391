"""Helpers shared by the program policy's tests (not a test module)."""

from hypothesis import strategies as st

from kvgate.admission.coordinator import Kind


def teach_prefill_rate(co, t: float, place, per_token: float, prefilled, reserve: int, prompt_tokens: int,
                       completion_tokens: int, prefix: str = "r") -> float:
    """Answer one one-turn call on ``place`` for each size in ``prefilled`` (tokens), each timed as 0.05 s +
    ``per_token`` x its size on the coordinator's clock, so ``co`` learns that prefill rate through release.
    Each call reserves ``reserve`` tokens for a prompt of ``prompt_tokens``. Returns the clock after (s)."""
    for i, pre in enumerate(prefilled):
        d = co.submit(f"{prefix}{i}", reserve, False, t, place=place, session_id=None, prompt_tokens=prompt_tokens)
        assert d.kind is Kind.ADMIT
        t += 0.05 + per_token * pre
        co.release(f"{prefix}{i}", t, {"prompt_tokens": pre, "cached_tokens": 0,
                                       "completion_tokens": completion_tokens})
    return t


@st.composite
def programs(draw, most: int = 6):
    """Multi-turn programs (1 to ``most`` of them, 2-6 turns each, growing contexts, tool gaps between), their
    events interleaved at random (each program's in order) with ticks: ops (kind, program, tokens, seconds
    since the last op) for a driver of turns, answers and ticks, where programs come back for their KV."""
    queues = []
    for i in range(draw(st.integers(1, most))):
        size, q = draw(st.integers(100, 600)), []
        for _ in range(draw(st.integers(2, 6))):
            q += [("turn", i, size, draw(st.floats(0.0, 2.0))), ("end", i, size, draw(st.floats(0.2, 2.0)))]
            size += draw(st.integers(50, 400))
        queues.append(q)
    ops = []
    while any(queues):
        q = draw(st.sampled_from([q for q in queues if q]))
        ops.append(q.pop(0))
        if draw(st.integers(0, 3)) == 0:
            ops.append(("tick", 0, 0, draw(st.floats(0.0, 1.0))))
    return ops
