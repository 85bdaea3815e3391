"""scripts/fidelity_table.py: the simulator-beside-engine table from two runs' summaries (pure)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "fidelity_table", Path(__file__).resolve().parent.parent / "scripts" / "fidelity_table.py")
ft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ft)


def _run(makespans: dict, cpu: bool, contention=None) -> dict:
    metrics = {}
    for arm, ms in makespans.items():
        m = {"makespan_s": {"mean": ms}, "recomputed_prefill_tokens": 100.0, "cached_per_turn": 50.0,
             "retractions": 0.0, "evicted_tokens": 10.0}
        if cpu:
            m["cpu_s"] = {"engines": ms / 2, "router": 1.0, "kvgate": 2.0, "client": 3.0, "other": 0.0}
            m["host_contention_s"] = contention
        metrics[arm] = m
    return {"metrics": metrics, "tiers": [[a] for a in sorted(makespans, key=makespans.get)]}


def test_errors_order_and_the_cpu_columns():
    out = ft.table(_run({"direct": 30.0, "lifecycle": 25.0}, True),
                   _run({"direct": 27.0, "lifecycle": 26.0}, True, contention=1.5))
    rows = [ln for ln in out.splitlines() if ln.startswith("| direct") or ln.startswith("| lifecycle")]
    assert rows[0].split(" | ")[6:] == ["-10%", "15.0 / 13.5", "6.0 / 6.0", "1.5 |"]
    assert rows[1].split(" | ")[6] == "+4%"
    assert "engine lifecycle < direct; simulator lifecycle < direct (the same). Largest makespan error 10%." in out


def test_runs_without_cpu_figures_give_the_table_without_those_columns():
    out = ft.table(_run({"direct": 30.0}, False), _run({"direct": 33.0}, True))
    assert "CPU" not in out and "| +10% |" in out
