"""Bad bench input stops `kvgate bench` with exit 2 and one line naming what is wrong, before any fleet starts
(no output directory, no processes). Pure argument and scenario checks; nothing is started."""

import argparse
import json

import pytest

from kvgate.bench import command as cli
from kvgate.bench.scenario import parse_scenario

GOOD = """
name: t
arms: [direct, proxy-only]
workload: {kind: agentic, groups: 1, group_size: 2, turns: {dist: const, value: 2}}
"""


def _run(tmp_path, scenario_text, *flags):
    sc = tmp_path / "s.yaml"
    sc.write_text(scenario_text)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    out = tmp_path / "out"
    return cli.run(p.parse_args(["--scenario", str(sc), "--out", str(out), "--no-progress", *flags])), out


@pytest.mark.parametrize("text, flags, expect", [
    ("arms: [direct]\nworkload: {kind: agentic}\nspeed: fast\n", [], "speed: must be a number > 0"),
    ("arms: [direct]\nworkload: {kind: agentic}\nengines: '2'\n", [], "engines: must be an integer"),
    ("arms: [direct]\nworkload: {kind: agentic}\nseed: abc\n", [], "seed: must be an integer"),
    ("arms: direct\nworkload: {kind: agentic}\n", [], "arms: must be a non-empty list"),
    ("arms: [direct]\nworkload: {kind: agentic}\nrouter_limits: 4\n", [], "router_limits: must be"),
    ("arms: [direct]\nworkload: {kind: agentic}\nrouter_limits: [0]\n", [], "router_limits: must be"),
    ("arms: [direct]\nworkload: {kind: agentic}\nreplicates: true\n", [], "replicates: must be"),
    ("arms: [direct]\nworkload: {kind: agentic, grup_size: 2}\n", [], "workload: unknown keys ['grup_size']"),
    ("arms: [direct]\nworkload: {kind: agentic, groups: 0}\n", [], "workload.groups: must be an integer >= 1"),
    ("arms: [direct]\nworkload: {kind: agentic, turns: {dist: cosnt, value: 2}}\n", [], "unknown distribution"),
    ("arms: [direct]\nworkload: {kind: agentic}\nsim_extra: {compute_profile: nope}\n", [],
     "sim_extra: argument --compute-profile: invalid choice: 'nope'"),
    ("arms: [direct]\nworkload: {kind: agentic}\nkvgate_extra: {bogus_option: 1}\n", [],
     "kvgate_extra: bogus_option: unknown key"),
    ("arms: [direct]\nworkload: {kind: agentic}\nkvgate_times: {session_idle_close_s: -1}\n", [],
     "kvgate_times.session_idle_close_s: must be"),
    ("arms: [direct\n", [], "not valid YAML"),
    ("arms: [direct]\nworkload: {kind: agentic}\nrouter_extra: [--load-monitor-interval, x]\n", [],
     "router_extra: --load-monitor-interval must be a number of seconds, got 'x'"),
    (GOOD, ["--speed", "0"], "--speed: must be a number > 0"),
    (GOOD, ["--speed", "nan"], "--speed: must be a number > 0"),
    (GOOD, ["--replicates", "0"], "--replicates: must be >= 1"),
    (GOOD, ["--arm-timeout-s", "0"], "--arm-timeout-s: must be > 0"),
    (GOOD, ["--arms", ""], "--arms: no arm named"),
    (GOOD, ["--arms", ","], "--arms: no arm named"),
    (GOOD, ["--arms", "direcct"], "--arms: unknown arm 'direcct'"),
    (GOOD, ["--arms", "router-limit-3"], "no arm to run (router-limit-N needs N in router_limits"),
    (GOOD, ["--compare", "/nonexistent/run"], "--compare: /nonexistent/run not found"),
    (GOOD, ["--sim-fit", "/nonexistent/fit.json"], "--sim-fit /nonexistent/fit.json: [Errno 2]"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, text, flags, expect):
    rc, out = _run(tmp_path, text, *flags)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and expect in err, err
    assert not out.exists()


def test_out_that_is_a_file(tmp_path, capsys):
    sc = tmp_path / "s.yaml"
    sc.write_text(GOOD)
    (tmp_path / "f").write_text("x")
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args(["--scenario", str(sc), "--out", str(tmp_path / "f")])) == 2
    assert "--out:" in capsys.readouterr().err


@pytest.mark.parametrize("content, expect", [
    ("{}", "is not a kvgate bench results.json"),
    ('{"ranking": null}', "is not a kvgate bench results.json"),
    ('{"ranking": ["a"], "tiers": [["a", 1]]}', "is not a kvgate bench results.json"),
    ("[1, 2]", "is not a kvgate bench results.json"),
    ("not json", "is not JSON"),
])
def test_compare_with_a_file_that_is_not_a_result(tmp_path, capsys, content, expect):
    prev = tmp_path / "prev"
    prev.mkdir()
    (prev / "results.json").write_text(content)
    rc, out = _run(tmp_path, GOOD, "--compare", str(prev))
    assert rc == 2 and expect in capsys.readouterr().err and not out.exists()


def test_compare_with_no_arm_in_common_says_so():
    prev = {"_path": "p", "ranking": ["direct", "proxy-only"], "tiers": [["direct", "proxy-only"]],
            "scenario": {"name": "other"}}
    c = cli._compare([["router-limit-4"]], ["router-limit-4"], prev, "tiny")
    assert c["same_ranking"] is None and "nothing to compare, the runs share 0 arm(s)" in c["text"]
    assert "that run was scenario other, this one tiny" in c["text"]
    c = cli._compare([["direct"], ["lifecycle"], ["proxy-only"]], ["direct", "lifecycle", "proxy-only"], prev, "other")
    assert c["same_ranking"] is False and "over the 2 arms in common" in c["text"]


def test_kvgate_extra_keeps_types_and_sim_extra_is_checked():
    sc = parse_scenario({"arms": ["direct"], "workload": {"kind": "agentic"},
                         "kvgate_extra": {"admission_chars_per_token": 1.0, "max_response_length": 1024},
                         "sim_extra": {"compute_profile": "qwen2.5-32b-h100"}})
    assert sc.kvgate_extra["max_response_length"] == 1024
    with pytest.raises(ValueError, match="sim_extra: unrecognized arguments"):
        parse_scenario({"arms": ["direct"], "workload": {"kind": "agentic"}, "sim_extra": {"no_such_flag": 1}})


def test_a_failed_arm_is_shown_and_ranked_last():
    from kvgate.bench.report import aggregate, failed_arms, markdown, ranked_tiers, summarize
    ok = {"requests": [{"session": "a", "start": 0.0, "ttft": 0.1, "end": 1.0, "ok": True, "output_tokens": 1}],
          "sessions": [{"id": "a", "step": 0, "start": 0.0, "end": 1.0, "ok": True}],
          "steps": [{"step": 0, "start": 0.0, "end": 1.0}], "sim_totals": {}, "kvgate_counters": None}
    cut = {**ok, "timed_out": True}
    m = {"direct": aggregate([summarize(ok, 1.0, 0), summarize(ok, 1.0, 0)]),
         "proxy-only": aggregate([summarize(ok, 1.0, 0), summarize(cut, 1.0, 0)])}
    assert m["proxy-only"]["failed"] is True and m["direct"]["failed"] is False
    assert failed_arms(m) == ["proxy-only"]
    assert ranked_tiers(m)[0] == [["direct"], ["proxy-only"]]
    assert "| proxy-only (did not finish) |" in markdown(m)
    text = cli._ranking_text([["direct"], ["proxy-only"]], 2, None, 0, ["proxy-only"])
    assert "Did not finish" in text and "proxy-only" in text and "nothing to test" in text
    json.dumps(m)  # results.json stays serialisable


def test_arm_settings_name_variants_of_an_arm_and_scale_their_durations():
    from kvgate.bench.runner import THUNDER_FLAGS, expand_arms
    sc = parse_scenario({"arms": ["direct-no-overload", "lifecycle+admission-program-thunder",
                                  "lifecycle+admission-program@fast"], "workload": {"kind": "agentic"}, "speed": 4,
                         "arm_settings": {"fast": {"admission_pause_victim": "ahead", "admission_resume_deadline_s": 20,
                                                   "admission_host_cache": False}}})
    arms = expand_arms(sc)
    assert [a.name for a in arms] == ["direct-no-overload", "lifecycle+admission-program-thunder",
                                      "lifecycle+admission-program@fast"]
    assert arms[0].router_flags == ("--disable-worker-overload-protection",) and arms[1].kvgate_flags == THUNDER_FLAGS
    assert arms[2].kvgate_flags == ("--admission-pause-victim", "ahead", "--admission-resume-deadline-s", "5.0",
                                    "--no-admission-host-cache")
    for bad, msg in ((["lifecycle@none"], "unknown"), (["direct@x"], "unknown")):
        with pytest.raises(ValueError, match=msg):
            parse_scenario({"arms": bad, "workload": {"kind": "agentic"}, "arm_settings": {"y": {}}})
    with pytest.raises(ValueError, match="arm_settings.x: kvgate_extra"):
        parse_scenario({"arms": ["lifecycle@x"], "workload": {"kind": "agentic"},
                        "arm_settings": {"x": {"admission_pause_victim": "random"}}})


def test_arms_flag_takes_a_settings_variant():
    from kvgate.bench.command import _pick_arms
    assert _pick_arms("direct,lifecycle+admission-program@fast,router-limit-8") == (
        ["direct", "lifecycle+admission-program@fast", "router-limit"],
        {"direct", "lifecycle+admission-program@fast", "router-limit-8"})
    with pytest.raises(ValueError, match="unknown arm"):
        _pick_arms("nothing@fast")


def test_the_kv_bound_scenario_runs_the_program_policy_under_resident_bounds():
    """configs/bench/agentic-kv-bound.yaml names arm settings resident-N: each runs the program arm with
    admission_program_max_resident N and a 900 s wait bound (30 s at speed 30), flags `kvgate serve` takes."""
    from pathlib import Path

    from kvgate.bench.runner import expand_arms
    from kvgate.bench.scenario import load_scenario
    from kvgate.cli import build_parser
    from kvgate.config import from_args

    sc = load_scenario(Path(__file__).resolve().parents[1] / "configs" / "bench" / "agentic-kv-bound.yaml")
    sizes = (1, 2, 3, 4, 6)
    sc.arms = [f"lifecycle+admission-program@resident-{n}" for n in sizes]
    for n, arm in zip(sizes, expand_arms(sc)):
        assert arm.name == f"lifecycle+admission-program@resident-{n}"
        assert arm.kvgate_flags == ("--admission-program-max-resident", str(n),
                                    "--agentic-admission-max-wait-s", str(900 / sc.speed))
        cfg = from_args(build_parser().parse_args(["serve", "--agentic-program-admission", "--admission-policy",
                                                   "program", *arm.kvgate_flags]))
        assert cfg.admission_program_max_resident == n


def test_sim_fit_files_bad_ones_stop_the_bench_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    for text, expect in [("{", "Expecting"), ('{"engines": 1}', "neither a 'fit' nor a 'slowdown'"),
                         ('{"fit": {"prefill": {}}}', "lacks 'decode'")]:
        bad.write_text(text)
        rc, out = _run(tmp_path, GOOD, "--sim-fit", str(bad))
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and f"--sim-fit {bad}: " in err and expect in err, err
        assert not out.exists()


def test_sim_settings_from_a_fit_and_a_contention_file():
    from kvgate.sim.fit import sim_settings
    fit = {"fit": {"prefill": {"base_ms": 12.712, "tokens_per_s": 2116.78, "attn_s_per_ctx_token2": -1.5e-8},
                   "decode": {"base_ms": 7.2437, "per_seq_ms": 0.3943, "per_ctx_token_us": -0.2}}}
    assert sim_settings(fit) == {"prefill_tokens_per_s": 2116.8, "prefill_base_ms": 12.71, "decode_base_ms": 7.244,
                                 "decode_per_seq_ms": 0.394, "decode_per_ctx_token_us": 0.0}
    assert sim_settings({"slowdown": {"prefill": 0.194, "decode": -0.01}}) == {
        "host_contention_prefill": 0.194, "host_contention_decode": 0.0}
    with pytest.raises(ValueError, match="not a throughput"):
        sim_settings({"fit": {"prefill": {"base_ms": 1, "tokens_per_s": float("inf")},
                              "decode": {"base_ms": 1, "per_seq_ms": 0, "per_ctx_token_us": 0}}})
    # the settings are sim-engine flags the scenario check accepts
    sc = parse_scenario({"arms": ["direct"], "workload": {"kind": "agentic"},
                         "sim_extra": {"compute_profile": "sglang-cpu-mlp", **sim_settings(fit),
                                       **sim_settings({"slowdown": {"prefill": 0.2, "decode": 0.4}})}})
    assert sc.sim_extra["host_contention_decode"] == 0.4
