"""A key whose range is checked only while its feature is on (Key.only_when) is not refused while the feature is
off, by design, nor is a rule between it and another key (kvgate.config.ORDERS); the warning that it does nothing
is one line naming the key, the flag that would enable it and, for a value out of range or breaking such a rule,
that the value would then be refused."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.cli import build_parser
from kvgate.config import KEYS, KEYS_BY_NAME, ORDERS, ConfigError, flag_name, validate

GATED = [k for k in KEYS if k.only_when is not None and k.check is not None]


def test_the_gated_keys_are_the_admission_numbers_each_with_a_flag():
    assert len(GATED) == 17 and {k.only_when for k in GATED} == {"agentic_program_admission"}
    flags = {o for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions
             for o in a.option_strings}
    assert "--agentic-program-admission" in flags and all(flag_name(k.name) in flags for k in GATED)


def test_an_out_of_range_headroom_with_admission_off_is_one_line_naming_key_flag_and_range():
    cfg = validate({"agentic_admission_headroom": 1.5})
    assert cfg.agentic_admission_headroom == 1.5 and cfg.warnings == [
        "agentic_admission_headroom: set to 1.5, but it does nothing while agentic_program_admission is off; "
        "--agentic-program-admission would enable it, and then 1.5 would be refused (it must be in (0, 1])"]
    try:
        validate({"agentic_admission_headroom": 1.5, "agentic_program_admission": True})
    except ConfigError as exc:  # what the warning said
        assert str(exc) == "agentic_admission_headroom: must be in (0, 1], got 1.5"
    else:
        raise AssertionError("not refused with admission on")


_numbers = st.one_of(st.integers(min_value=-10**6, max_value=10**6),
                     st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))


def _order_allowed(name: str, value) -> str | None:
    """What a rule between keys (kvgate.config.ORDERS) asks of ``name`` set to ``value`` alone, the other key at
    its default, when the rule is broken; else None."""
    for o in ORDERS:
        lo = value if name == o.low else KEYS_BY_NAME[o.low].default
        hi = value if name == o.high else KEYS_BY_NAME[o.high].default
        if name in (o.low, o.high) and lo > hi and not (o.high_off is not None and hi == o.high_off):
            if name == o.low:
                return f"<= {o.high} ({hi}, its default)"
            return f">= {o.low} ({lo}, its default)" + (f" or {o.high_off:g}" if o.high_off is not None else "")
    return None


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(GATED), _numbers)
def test_any_gated_key_any_value_with_its_feature_off_is_one_line_that_says_whether_it_would_be_refused(key, x):
    value = float(x) if key.type is float else int(x)
    if value == key.default:
        return
    cfg = validate({key.name: value})  # never refused while the feature is off, nor for a rule with another key
    lines = [w for w in cfg.warnings if w.startswith(f"{key.name}:")]
    assert len(lines) == 1 and "\n" not in lines[0]
    head = (f"{key.name}: set to {value!r}, but it does nothing while {key.only_when} is off; "
            f"{flag_name(key.only_when)} would enable it")
    out_of_range = not key.check(value)
    allowed = key.allowed if out_of_range else _order_allowed(key.name, value)
    tail = f", and then {value!r} would be refused (it must be {allowed})" if allowed else ""
    assert lines[0] == head + tail
    on = {key.only_when: True, key.name: value}
    try:
        validate(on)
        assert not allowed
    except ConfigError as exc:
        assert allowed and len(exc.lines) == 1 and exc.lines[0].startswith(f"{key.name}: must be {allowed}, got ")
        if out_of_range:
            assert str(exc) == f"{key.name}: must be {key.allowed}, got {value!r}"
