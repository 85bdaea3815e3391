"""Rules between two keys (kvgate.config.ORDERS) and a config with several problems.

A rule between keys is checked exactly when the keys' own ranges are (Key.only_when): the pause ratios, numbers
of admission, are no error while admission is off, only the one-line warning that the key does nothing, which
says the value would then be refused. A refusal names the key the user wrote (not the other one, left at its
default) and what to set. ``kvgate check-config`` (and ``serve``) report every problem, one line each naming its
key, and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.cli import main
from kvgate.config import KEYS_BY_NAME, ORDERS, ConfigError, validate

ROOT = Path(__file__).resolve().parent.parent


def _error_lines(raw: dict) -> list[str]:
    try:
        validate(raw)
    except ConfigError as exc:
        assert str(exc) == "\n".join(exc.lines)
        return exc.lines
    return []


def _check_config_ok(tmp_path, capsys, text: str):
    """``kvgate check-config`` on a file holding ``text``: it answers 0; returns (the file, what it printed)."""
    f = tmp_path / "c.yaml"
    f.write_text(text)
    assert main(["check-config", str(f)]) == 0
    return f, capsys.readouterr()


# --- the pause ratios a new user wrote ------------------------------------------------------------------

def test_a_start_ratio_alone_with_admission_off_is_one_warning_and_check_config_answers_ok(tmp_path, capsys):
    cfg = validate({"admission_pause_start_ratio": 0.125})
    assert cfg.admission_pause_start_ratio == 0.125 and cfg.warnings == [
        "admission_pause_start_ratio: set to 0.125, but it does nothing while agentic_program_admission is off; "
        "--agentic-program-admission would enable it, and then 0.125 would be refused (it must be >= "
        "admission_pause_stop_ratio (0.2, its default) or 0)"]
    f, out = _check_config_ok(tmp_path, capsys, "admission_pause_start_ratio: 0.125\n")
    assert out.err.splitlines() == [f"kvgate: config warning: {cfg.warnings[0]}"]
    assert out.out.startswith(f"{f}: ok")


def test_with_admission_on_the_refusal_names_the_key_written_and_what_to_set():
    on = {"agentic_program_admission": True, "admission_policy": "program"}
    assert _error_lines({**on, "admission_pause_start_ratio": 0.125}) == [
        "admission_pause_start_ratio: must be >= admission_pause_stop_ratio (0.2, its default) or 0, got 0.125: "
        "set admission_pause_stop_ratio to at most 0.125 as well"]
    assert _error_lines({**on, "admission_pause_stop_ratio": 2}) == [
        "admission_pause_stop_ratio: must be <= admission_pause_start_ratio (1.5, its default), got 2.0: "
        "set admission_pause_start_ratio to at least 2.0 as well"]
    assert _error_lines({**on, "admission_pause_start_ratio": 0.5, "admission_pause_stop_ratio": 0.8}) == [
        "admission_pause_stop_ratio: must be <= admission_pause_start_ratio (0.5), got 0.8"]
    assert _error_lines({**on, "admission_pause_start_ratio": 0.125, "admission_pause_stop_ratio": 0.1}) == []
    assert _error_lines({**on, "admission_pause_start_ratio": 0}) == []  # 0: pause whatever re-prefill costs


def test_under_the_fifo_policy_the_ratios_are_said_to_do_nothing():
    cfg = validate({"agentic_program_admission": True, "admission_pause_start_ratio": 3.0,
                    "admission_wait_bound": "reprefill"})
    assert cfg.warnings == [
        "admission_wait_bound: set to 'reprefill', but it does nothing while admission_policy is fifo (a program "
        "policy key); --admission-policy program would enable it",
        "admission_pause_start_ratio: set to 3.0, but it does nothing while admission_policy is fifo (a program "
        "policy key); --admission-policy program would enable it"]


def test_the_idle_floor_and_ceiling_are_checked_always_as_their_ranges_are_naming_the_key_written():
    assert _error_lines({"session_idle_ceiling_s": 5}) == [
        "session_idle_ceiling_s: must be >= session_idle_floor_s (10.0, its default), got 5.0: set "
        "session_idle_floor_s to at most 5.0 as well"]
    assert _error_lines({"session_idle_floor_s": 1000}) == [
        "session_idle_floor_s: must be <= session_idle_ceiling_s (900.0, its default), got 1000.0: set "
        "session_idle_ceiling_s to at least 1000.0 as well"]


# --- a property over the rules between feature-gated keys ----------------------------------------------

def _value(name: str):
    key = KEYS_BY_NAME[name]
    # in the key's own range, 0 included where allowed (the pause start ratio's "always")
    lo = 0.0 if key.check(0.0) else 0.001
    return st.one_of(st.just(lo), st.just(float(key.default)),
                     st.floats(min_value=lo, max_value=2000.0, allow_nan=False, allow_infinity=False))


@st.composite
def _case(draw):
    order = draw(st.sampled_from(ORDERS))
    written = draw(st.sampled_from([{order.low}, {order.high}, {order.low, order.high}]))
    raw = {k: draw(_value(k)) for k in sorted(written)}
    gates = {KEYS_BY_NAME[k].only_when for k in (order.low, order.high)} - {None}
    on = draw(st.booleans())
    raw.update({g: on for g in gates})
    return order, written, raw, on or not gates


@settings(max_examples=400, deadline=None)
@given(_case())
def test_a_rule_between_keys_refuses_only_with_its_feature_on_naming_a_key_written(case):
    order, given_keys, raw, applies = case
    full = {order.low: KEYS_BY_NAME[order.low].default, order.high: KEYS_BY_NAME[order.high].default,
            **{k: float(v) for k, v in raw.items() if k in (order.low, order.high)}}
    # what the user chose: a key given at its default (a copy of the example config gives them all) is not
    written = {k for k in given_keys if full[k] != KEYS_BY_NAME[k].default}
    lo, hi = full[order.low], full[order.high]
    broken = lo > hi and not (order.high_off is not None and hi == order.high_off)
    named = order.high if written == {order.high} else order.low
    try:
        cfg = validate(raw)
    except ConfigError as exc:
        assert applies and broken, exc.lines
        assert len(exc.lines) == 1 and exc.lines[0].startswith(f"{named}: must be ") and named in written
        other = order.low if named == order.high else order.high
        # the key left at its default is said to be one, with what to set it to
        assert (f"{other} (" in exc.lines[0]) and (("as well" in exc.lines[0]) == (other not in written))
        assert exc.lines[0].endswith(f"got {full[named]}" + (
            f": set {other} to {'at most' if other == order.low else 'at least'} {full[named]} as well"
            if other not in written else ""))
        return
    assert not (applies and broken)
    said = [w for w in cfg.warnings if "would be refused" in w]
    if broken:  # the feature is off: the warning on the key a refusal would name says so, once
        assert len(said) == 1 and said[0].startswith(f"{named}: set to ") and "\n" not in said[0]
    else:
        assert said == []


# --- every problem at once ----------------------------------------------------------------------------

# independent problems, each with the line that names it
PROBLEMS = {
    "port": ("x", "port: expected an integer, got 'x'"),
    "workers": (0, "workers: must be a positive integer or auto, got 0"),
    "log_level": ("loud", "log_level: must be one of debug, info, warning, error, got 'loud'"),
    "max_body_bytes": (0, "max_body_bytes: must be > 0, got 0"),
    "session_idle_ceiling_s": (5, "session_idle_ceiling_s: must be >= session_idle_floor_s (10.0, its default), "
                                  "got 5.0: set session_idle_floor_s to at most 5.0 as well"),
    "upstream": ("http://r:1/v1", "upstream: http://r:1/v1 ends in an API path (/v1); kvgate sends each request's "
                                  "own path (/v1/completions, /generate) to the router, so give its base URL "
                                  "(http://r:1)"),
    "engines": (["e:1"], "engines: expected an http(s) URL like http://127.0.0.1:30000, got 'e:1'"),
    "sesion_header": ("X", "sesion_header: unknown key (did you mean session_header?)"),
    "session_field_regex": ("(", "session_field_regex: needs session_field (the body field the regex is applied "
                                 "to)"),
    "admission_eval_rules": ([{"pth": "/x"}], None),
}


@settings(max_examples=200, deadline=None)
@given(st.sets(st.sampled_from(sorted(PROBLEMS)), min_size=1))
def test_every_problem_is_one_line_naming_its_key(names):
    lines = _error_lines({n: PROBLEMS[n][0] for n in names})
    assert sorted(line.split(":")[0] for line in lines) == sorted(names)
    for line in lines:
        assert "\n" not in line
        want = PROBLEMS[line.split(":")[0]][1]
        assert want is None or line == want


def test_check_config_reports_every_error_and_exits_2(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("port: x\nworkers: 0\nsession_idle_ceiling_s: 5\nupstrem: http://r:1\n")
    res = subprocess.run([sys.executable, "-m", "kvgate", "check-config", str(f), "--log-level", "loud"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr.splitlines() == [
        "kvgate: config error: port: expected an integer, got 'x'",
        "kvgate: config error: workers: must be a positive integer or auto, got 0",
        "kvgate: config error: upstrem: unknown key (did you mean upstream?)",
        "kvgate: config error: log_level: must be one of debug, info, warning, error, got 'loud'",
        "kvgate: config error: session_idle_ceiling_s: must be >= session_idle_floor_s (10.0, its default), got "
        "5.0: set session_idle_floor_s to at most 5.0 as well"]


@pytest.mark.parametrize("flag", ["--port", "--session-idle-close-s"])
def test_a_flag_that_does_not_parse_is_one_line_among_the_others(flag, capsys):
    assert main(["check-config", flag, "many", "--workers", "0"]) == 2
    key = flag.removeprefix("--").replace("-", "_")
    kind = "an integer" if key == "port" else "a number"
    assert capsys.readouterr().err.splitlines() == [
        f"kvgate: config error: {key}: expected {kind}, got 'many'",
        "kvgate: config error: workers: must be a positive integer or auto, got 0"]


def test_an_edited_copy_of_the_example_config_names_the_key_edited(tmp_path, capsys):
    """The example gives every key (at its default): the key the user changed is the one named."""
    import re
    text = (ROOT / "configs" / "kvgate.yaml").read_text()
    text = re.sub(r"(?m)^admission_pause_start_ratio: 1\.5 ", "admission_pause_start_ratio: 0.125", text)
    f = tmp_path / "kvgate.yaml"
    f.write_text(text)
    assert main(["check-config", str(f)]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "kvgate: config warning: admission_pause_start_ratio: set to 0.125, but it does nothing while "
        "agentic_program_admission is off; --agentic-program-admission would enable it, and then 0.125 would be "
        "refused (it must be >= admission_pause_stop_ratio (0.2, its default) or 0)"]
    assert main(["check-config", str(f), "--agentic-program-admission", "--admission-policy", "program"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "kvgate: config error: admission_pause_start_ratio: must be >= admission_pause_stop_ratio (0.2, its default) "
        "or 0, got 0.125: set admission_pause_stop_ratio to at most 0.125 as well"]


def test_the_program_policy_without_session_lifecycle_is_one_warning_and_starts(tmp_path, capsys):
    """With lifecycle off kvgate knows no sessions: every request is a one-turn program, none is ever paused.
    Valid, but not what a user who asked for the program policy expects: check-config says so and answers ok."""
    cfg = validate({"agentic_program_admission": True, "admission_policy": "program"})
    assert cfg.warnings == [
        "admission_policy: program with agentic_session_lifecycle off: kvgate knows no sessions, so every request "
        "is a one-turn program (admitted when its engine has room, never paused); --agentic-session-lifecycle "
        "would make each session a program"]
    _, out = _check_config_ok(tmp_path, capsys, "agentic_program_admission: true\nadmission_policy: program\n")
    assert out.err.splitlines() == [f"kvgate: config warning: {cfg.warnings[0]}"]
    for quiet in ({"agentic_program_admission": True, "admission_policy": "program", "agentic_session_lifecycle": True},
                  {"agentic_program_admission": True}, {"admission_policy": "program"}):
        assert not any(w.startswith("admission_policy: program with") for w in validate(quiet).warnings), quiet


# --- settings a new user of replicas wrote -----------------------------------------------------------------

def test_a_router_policy_no_router_knows_is_one_warning_with_the_nearest_name(tmp_path, capsys):
    on = {"agentic_session_lifecycle": True}
    cfg = validate({**on, "router_policy": "cache-aware"})
    assert cfg.warnings[0] == (
        "router_policy: 'cache-aware' is not a router's --policy (random, round_robin, passthrough, cache_aware, "
        "power_of_two, least_load, manual, consistent_hashing, prefix_hash); did you mean cache_aware? (it tells "
        "kvgate how the router was started, for the routing-key warning)")
    assert not any(w.startswith("router_policy: 'cache_aware'") for w in validate({**on, "router_policy": "cache_aware"}).warnings)
    assert "did you mean" not in validate({**on, "router_policy": "fastest"}).warnings[0]
    _, out = _check_config_ok(tmp_path, capsys, "agentic_session_lifecycle: true\nrouter_policy: cache-aware\n")
    assert f"kvgate: config warning: {cfg.warnings[0]}" in out.err.splitlines()


def test_a_redis_session_ttl_not_above_the_idle_close_is_one_warning():
    shared = {"state_backend": "redis", "agentic_session_lifecycle": True, "session_idle_close_s": 300}
    cfg = validate({**shared, "redis_session_ttl_s": 10})
    assert cfg.warnings == [
        "redis_session_ttl_s: 10 is not above session_idle_close_s (300): a session's shared record (its activity "
        "and engine) expires before the session is idle, so the replicas no longer agree on it; keep "
        "redis_session_ttl_s above session_idle_close_s"]
    for quiet in ({**shared, "redis_session_ttl_s": 301}, {**shared, "redis_session_ttl_s": 10, "session_idle_close_s": 0},
                  {**shared, "redis_session_ttl_s": 10, "agentic_session_lifecycle": False}):
        assert not any(w.startswith("redis_session_ttl_s: 10 is not") for w in validate(quiet).warnings), quiet
    adaptive = {**shared, "session_idle_close_mode": "adaptive", "session_idle_close_s": 0, "redis_session_ttl_s": 60}
    assert validate(adaptive).warnings == [  # adaptive: the threshold may go up to its ceiling (900 s)
        "redis_session_ttl_s: 60 is not above session_idle_ceiling_s (900): a session's shared record (its activity "
        "and engine) expires before the session is idle, so the replicas no longer agree on it; keep "
        "redis_session_ttl_s above session_idle_ceiling_s"]
    assert validate({**adaptive, "redis_session_ttl_s": 901}).warnings == []


def test_the_program_policy_on_several_workers_is_one_warning():
    on = {"state_backend": "redis", "agentic_session_lifecycle": True, "agentic_program_admission": True}
    cfg = validate({**on, "workers": 2, "admission_policy": "program"})
    assert cfg.warnings == [
        "admission_policy: program with workers: 2: each worker keeps its own working sets and the kernel spreads "
        "connections over the workers, so each sees part of every program; run one worker per kvgate with the "
        "program policy (replicas behind a load balancer with session affinity, docs/replicas.md)"]
    assert validate({**on, "workers": 2}).warnings == []  # the fifo ledger is shared in Redis
    assert validate({**on, "workers": 1, "admission_policy": "program"}).warnings == []


def test_a_redis_url_whose_database_is_not_a_number_is_refused_naming_the_key():
    for bad in ("redis://127.0.0.1:6379/abc", "redis://127.0.0.1:6379/0?db=x", "unix:///run/redis.sock?db=one",
                "redis://h/\u00b2"):
        assert _error_lines({"state_backend": "redis", "redis_url": bad}) == [
            f"redis_url: must be a redis://, rediss:// or unix:// URL, its database (/N or ?db=N) a number, "
            f"got {bad!r}"], bad
    for good in ("redis://127.0.0.1:6379/3", "redis://127.0.0.1:6379", "rediss://h:1/", "unix:///run/r.sock?db=2",
                 "redis://h/%31"):
        assert _error_lines({"state_backend": "redis", "redis_url": good}) == [], good


def test_a_redis_url_is_shown_without_its_password():
    from kvgate.config_credentials import redis_url_shown
    assert redis_url_shown("redis://:s3cret@10.0.0.5:6380/2") == "redis://10.0.0.5:6380/2"
    assert redis_url_shown("rediss://kv:s3cret@[::1]:7/1?db=1") == "rediss://[::1]:7/1?db=1"
    assert redis_url_shown("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
