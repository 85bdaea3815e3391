"""Helpers shared by the program policy's tests (not a test module)."""

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
