"""kvgate bench-proxy --workers N: the ARM-wN arms (kvgate serve --workers N on Redis) and their readiness."""

from __future__ import annotations

import argparse
import json

import pytest

from kvgate.bench import proxy_bench
from kvgate.bench.proxy_report import arm_order, base_arm, front_of
from kvgate.common.metrics import Metrics
from kvgate.proxy.process_metrics import merge_expositions
from kvgate.tools import procs


def test_worker_arms_compare_with_the_hop_in_front_of_their_base_arm():
    assert base_arm("kvgate-nosmg-w2") == "kvgate-nosmg" and base_arm("lifecycle+admission-w12") == "lifecycle+admission"
    assert front_of("kvgate-nosmg-w2") == "direct" and front_of("lifecycle+admission-w2") == "smg"
    assert front_of("nginx-proxy") == "smg"  # the null proxy sits in front of smg, as kvgate does
    assert arm_order(["kvgate-nosmg-w2", "kvgate-off-w2", "smg", "kvgate-nosmg", "kvgate-off", "kvgate-nosmg-w1"]) == [
        "smg", "kvgate-off", "kvgate-off-w2", "kvgate-nosmg", "kvgate-nosmg-w1", "kvgate-nosmg-w2"]


def _worker(engines: int, degraded: int | None) -> str:
    m = Metrics()
    m.engines.labels("regular").set(engines)
    text = m.render()[0].decode()
    if degraded is not None:
        text += f"# HELP agentic_kv_budget_degraded d\n# TYPE agentic_kv_budget_degraded gauge\nagentic_kv_budget_degraded {degraded}\n"
    return text


def test_workers_ready_needs_every_worker_with_engines_and_a_ledger():
    ok = merge_expositions([("0", _worker(1, 0)), ("1", _worker(1, 0))], 2).decode()
    assert proxy_bench.workers_ready(ok, 2, ledger=True)
    down = merge_expositions([("0", _worker(1, 0)), ("1", None)], 2).decode()
    assert not proxy_bench.workers_ready(down, 2, ledger=False)
    no_engine = merge_expositions([("0", _worker(1, 0)), ("1", _worker(0, 0))], 2).decode()
    assert not proxy_bench.workers_ready(no_engine, 2, ledger=False)
    degraded = merge_expositions([("0", _worker(1, 0)), ("1", _worker(1, 1))], 2).decode()
    assert proxy_bench.workers_ready(degraded, 2, ledger=False) and not proxy_bench.workers_ready(degraded, 2, True)


def test_baseline_arms_get_worker_variants_and_the_scaling_is_per_round():
    arms = proxy_bench.with_worker_arms(["direct", "smg", "lifecycle", "lifecycle@base"], [1, 2])
    assert arms == ["direct", "smg", "lifecycle", "lifecycle@base", "lifecycle-w1", "lifecycle-w2",
                    "lifecycle-w1@base", "lifecycle-w2@base"]
    from kvgate.bench.proxy_report import Sample, markdown, summarise
    rps = {0: {"lifecycle-w1": 100, "lifecycle-w2": 180, "lifecycle-w1@base": 50, "lifecycle-w2@base": 60},
           1: {"lifecycle-w1": 80, "lifecycle-w2": 160, "lifecycle-w1@base": 40, "lifecycle-w2@base": 50},
           2: {"lifecycle-w1": 90, "lifecycle-w2": 153}}
    samples = [Sample(r, a, "small", "throughput", rps=v) for r, by in rps.items() for a, v in by.items()]
    samples += [Sample(r, a, "small", "latency", p50_us=100.0) for r in rps for a in ["direct", "smg", *rps[0]]]
    s = summarise(samples)
    assert s.scaling["small"]["lifecycle-w2"] == (1.8, 1.7, 2.0)   # per round: 1.8, 2.0, 1.7
    assert s.scaling["small"]["lifecycle-w2@base"] == (1.225, 1.2, 1.25)
    assert "lifecycle-w1" not in s.scaling["small"]
    assert "| small /generate, req/s of N workers / 1 worker, per round |" in markdown(s)
    assert "1.80x (1.70-2.00)" in markdown(s)


def test_backend_figures_sum_every_workers_fallbacks_and_batches():
    text = merge_expositions([("0", _worker(1, 0)), ("1", _worker(1, 0))], 2).decode()
    assert proxy_bench.backend_figures(text) == {"bypass": 0.0, "calls": 0.0, "ops": 0.0}
    m = Metrics()
    m.state_backend_bypass.labels("turn").inc(3)
    m.state_backend_bypass.labels("admission").inc(2)
    m.state_backend_calls.inc(10)
    m.state_backend_ops.inc(70)
    text = merge_expositions([("0", m.render()[0].decode()), ("1", m.render()[0].decode())], 2).decode()
    assert proxy_bench.backend_figures(text) == {"bypass": 10.0, "calls": 20.0, "ops": 140.0}


@pytest.mark.skipif(proxy_bench.missing_tools() is not None or procs.find_executable("redis-server") is None,
                    reason=str(proxy_bench.missing_tools() or "redis-server not installed"))
def test_a_tiny_run_with_two_workers(tmp_path):
    parser = argparse.ArgumentParser()
    proxy_bench.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), "--rounds", "1", "--latency-s", "1", "--throughput-s", "1",
                              "--connections", "8", "--arms", "kvgate-nosmg", "--workers", "1", "2",
                              "--shapes", "small", "--throughput-shapes", "small"])
    assert proxy_bench.run(args) == 0
    report = json.loads((tmp_path / "proxy-bench.json").read_text())
    assert report["arms"] == ["direct", "smg", "kvgate-nosmg", "kvgate-nosmg-w1", "kvgate-nosmg-w2"]
    s = report["summary"]
    assert s["errors"] == 0
    rps, cpu = s["max_rps"]["small"], s["cpu_us_per_request"]["small"]
    assert all(rps[a] > 10 for a in report["arms"])
    # the workers' CPU is counted (they run in process groups of their own, under the supervisor)
    assert cpu["kvgate-nosmg-w2"] > 0.25 * cpu["kvgate-nosmg"] > 0
    assert "kvgate-nosmg-w2 adds" in (tmp_path / "proxy-bench.md").read_text()


def test_placing_arms_replace_smgs_hop_and_are_compared_with_it():
    """kvgate placing sessions sends /generate to the engine itself: its hop is measured over direct, like
    smg's, and its ratio says whether the request is slower than through smg alone."""
    from kvgate.bench.proxy_report import Sample, markdown, summarise
    assert front_of("placement+admission") == "direct" and front_of("placement-w2") == "direct"
    rows = [Sample(r, arm, "small", "latency", p50_us=v) for r in range(3)
            for arm, v in (("direct", 10.0), ("smg", 210.0), ("lifecycle+admission", 800.0),
                           ("placement+admission", 310.0))]
    s = summarise(rows)
    assert s.added["small"] == {"smg": 200.0, "lifecycle+admission": 590.0, "placement+admission": 300.0}
    assert s.ratio["small"]["placement+admission"] == 1.5
    assert "smg is not on their path" in markdown(s)
