"""The speed factor scales every duration together (pure)."""

import argparse

import pytest

from kvgate.bench.scenario import KVGATE_TIME_DEFAULTS, parse_scenario, sim_extra_flags
from kvgate.bench.speed import kvgate_flags, scale
from kvgate.sim import args as sim_cli


def test_every_duration_divides_by_the_factor_and_ratios_stay():
    times = {"session_idle_close_s": 30.0, "admission_poll_interval_s": 2.0, "agentic_admission_max_wait_s": 30.0,
             "discovery_interval_s": 10.0, "session_close_drain_s": 30.0, "admission_window_s": 60.0,
             "admission_lease_ttl_s": 3600.0}
    s = scale(4.0, times, router_queue_timeout_s=600.0, sample_interval_s=2.0)
    assert s.sim_speed == 4.0
    assert s.kvgate_times == {"session_idle_close_s": 7.5, "admission_poll_interval_s": 0.5,
                              "agentic_admission_max_wait_s": 7.5, "discovery_interval_s": 2.5,
                              "session_close_drain_s": 7.5, "admission_window_s": 15.0,
                              "admission_lease_ttl_s": 900.0}
    assert s.router_queue_timeout_s == 150.0
    assert s.sample_interval_s == 0.5
    assert s.wall(2.5) == 0.625 and s.sim(0.625) == 2.5        # tool gaps and trace timestamps
    # ratio idle-close : poll interval is 15 at speed 1 and at speed 4
    assert s.kvgate_times["session_idle_close_s"] / s.kvgate_times["admission_poll_interval_s"] == 15.0


def test_zero_means_never_and_stays_zero():
    assert scale(8.0, {"session_idle_close_s": 0.0}, 60.0, 1.0).kvgate_times == {"session_idle_close_s": 0.0}


def test_staleness_floor_is_reported():
    # kvgate: stale after max(3 x poll, 5 s). At speed 1 with a 2 s poll: 6 s; at speed 4: 0.5 s poll -> the
    # 5 s floor, which is 20 s of simulated time (the one duration that does not scale).
    assert scale(1.0, {"admission_poll_interval_s": 2.0}, 60.0, 1.0).stale_after_s == 6.0
    s4 = scale(4.0, {"admission_poll_interval_s": 2.0}, 60.0, 1.0)
    assert (s4.stale_after_s, s4.stale_after_sim_s) == (5.0, 20.0)


def test_bad_speed_raises():
    with pytest.raises(ValueError):
        scale(0.0, {}, 1.0, 1.0)


def test_flags_are_kvgate_serve_flags():
    assert kvgate_flags({"admission_poll_interval_s": 0.5, "session_idle_close_s": 7.5}) == [
        "--admission-poll-interval-s", "0.5", "--session-idle-close-s", "7.5"]


def test_scenario_fills_kvgate_time_defaults_and_rejects_unknowns():
    sc = parse_scenario({"arms": ["direct"], "workload": {"kind": "agentic"},
                         "kvgate_times": {"session_idle_close_s": 30}})
    assert sc.kvgate_times == {**KVGATE_TIME_DEFAULTS, "session_idle_close_s": 30.0}
    with pytest.raises(ValueError, match="arms"):
        parse_scenario({"arms": ["nope"], "workload": {"kind": "agentic"}})
    with pytest.raises(ValueError, match="kvgate_times"):
        parse_scenario({"arms": ["direct"], "workload": {"kind": "agentic"}, "kvgate_times": {"poll": 1}})
    with pytest.raises(ValueError, match="unknown keys"):
        parse_scenario({"arms": ["direct"], "workload": {"kind": "agentic"}, "sped": 2})
    assert sc.replicates == 1
    assert parse_scenario({"arms": ["direct"], "workload": {"kind": "agentic"}, "replicates": 3}).replicates == 3
    for bad in (0, 1.5, "3"):
        with pytest.raises(ValueError, match="replicates"):
            parse_scenario({"arms": ["direct"], "workload": {"kind": "agentic"}, "replicates": bad})


def test_shipped_scenarios_parse():
    from pathlib import Path

    from kvgate.bench.scenario import load_scenario
    root = Path(__file__).resolve().parent.parent / "configs" / "bench"
    names = sorted(p.stem for p in root.glob("*.yaml"))
    assert {"agentic-kv-bound", "agentic-roomy", "mooncake-window"} <= set(names)
    for n in names:
        sc = load_scenario(root / f"{n}.yaml")
        assert sc.speed > 0
        # every sim_extra key is a flag the simulator takes (a typo would fail only when the bench starts engines)
        p = argparse.ArgumentParser()
        sim_cli.add_arguments(p)
        p.parse_args(sim_extra_flags(sc.sim_extra))


def test_arms_flag_picks_any_known_arm():
    from kvgate.bench.command import _pick_arms
    from kvgate.bench.runner import expand_arms
    assert _pick_arms("proxy-only,lifecycle-inferred") == (["proxy-only", "lifecycle-inferred"],
                                                            {"proxy-only", "lifecycle-inferred"})
    arms, keep = _pick_arms("router-limit-8,direct")
    sc = parse_scenario({"arms": ["direct"], "workload": {"kind": "agentic"}, "router_limits": [8, 16]})
    sc.arms = arms
    picked = [a.name for a in expand_arms(sc) if a.name in keep or a.name.rsplit("-", 1)[0] in keep]
    assert picked == ["router-limit-8", "direct"]
    for bad in ("nope", "lifecycle-2", "direct,admision"):
        with pytest.raises(ValueError, match="unknown arm"):
            _pick_arms(bad)


def test_many_programs_stays_in_the_regime_its_comment_claims():
    # many small programs: each a few % of one engine's KV pool, the step's working set 2-3x the fleet's KV, on
    # every seed the bench runs (the same four workloads in every arm)
    from pathlib import Path

    from kvgate.bench.scenario import load_scenario
    from kvgate.bench.workload import plan_agentic, plan_summary
    sc = load_scenario(Path(__file__).resolve().parent.parent / "configs" / "bench" / "many-programs.yaml")
    fleet = sc.engines * sc.max_total_num_tokens
    for seed in range(sc.seed, sc.seed + sc.replicates):
        s = plan_summary(plan_agentic(sc.workload, seed))
        assert 96 <= s["sessions"] <= 192
        assert 2.0 <= s["working_set_tokens"] / fleet <= 3.0
        assert s["final_context_tokens_mean"] <= 0.05 * sc.max_total_num_tokens
        assert s["final_context_tokens_max"] <= 0.07 * sc.max_total_num_tokens
        assert s["tool_gap_s_max"] <= 30.0


def test_smgs_load_monitor_interval_scales_in_whole_seconds_and_reaches_smgs_command(tmp_path):
    """smg polls each engine's /v1/loads every --load-monitor-interval seconds (10 by default); its worker
    overload protection acts on those figures. Before, the bench left it at 10 s of wall time, so at speed 6
    smg saw the simulated engines once a simulated minute (real engines: every 10 s)."""
    from kvgate.bench.runner import Fleet, expand_arms
    from kvgate.bench.speed import split_load_monitor_interval
    assert [scale(s, {}, 60.0, 1.0).router_load_monitor_interval_s for s in (1, 2, 4, 6, 8, 20, 40)] == \
        [10, 5, 2, 2, 1, 1, 1]  # 10 / 4 = 2.5 rounds to even (2); never below smg's minimum of 1
    assert split_load_monitor_interval(["--x", 1, "--load-monitor-interval", "30"]) == (["--x", "1"], 30.0)
    assert split_load_monitor_interval(["--load-monitor-interval=4"]) == ([], 4.0)
    assert split_load_monitor_interval([]) == ([], 10)
    for bad in (["--load-monitor-interval"], ["--load-monitor-interval", "x"], ["--load-monitor-interval", "0"]):
        with pytest.raises(ValueError, match="load-monitor-interval"):
            split_load_monitor_interval(bad)
    sc = parse_scenario({"name": "t", "speed": 6, "arms": ["direct"], "router_extra": ["--load-monitor-interval", 30],
                         "workload": {"kind": "agentic"}})
    scaled = scale(sc.speed, sc.kvgate_times, sc.router_queue_timeout_s, sc.sample_interval_s,
                   split_load_monitor_interval(sc.router_extra)[1])
    cmd = Fleet(sc, expand_arms(sc)[0], scaled, tmp_path).router_command(1, 2)
    assert cmd.count("--load-monitor-interval") == 1 and cmd[cmd.index("--load-monitor-interval") + 1] == "5"
