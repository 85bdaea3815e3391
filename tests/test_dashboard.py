"""The committed Grafana dashboard is what kvgate/tools/dashboard.py builds, and a valid grafana-foundation-sdk model.

(tests/test_prometheus_dashboard.py evaluates every query against a real Prometheus.)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from kvgate.tools import dashboard

DASHBOARD = Path(__file__).resolve().parent.parent / "configs" / "grafana" / "kvgate.json"


def _sdk():
    """grafana-foundation-sdk (test extra); skip without it, fail under CI."""
    try:
        import grafana_foundation_sdk  # noqa: F401
    except ImportError:
        reason = "grafana-foundation-sdk is not installed (pip install -e '.[test]')"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_committed_json_is_what_the_code_builds():
    _sdk()
    assert DASHBOARD.read_text() == dashboard.render(), \
        "configs/grafana/kvgate.json is stale: run python -m kvgate.tools.dashboard --out configs/grafana/kvgate.json"


def test_committed_json_loads_as_an_sdk_dashboard_model_without_loss(committed):
    _sdk()
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard, Panel, RowPanel
    from grafana_foundation_sdk.models.prometheus import Dataquery

    register_default_plugins()
    model = Dashboard.from_json(committed)
    assert json.loads(JSONEncoder().encode(model)) == committed  # every field understood by the model
    assert model.uid == "kvgate" and model.schema_version == 41
    rows = [p for p in model.panels if isinstance(p, RowPanel)]
    assert [r.title for r in rows] == ["Sessions", "Admission", "Budget", "Programs", "Engines", "Proxy"]
    panels = [p for p in model.panels if isinstance(p, Panel)]
    assert len(panels) == len(dashboard.panels()) == 37
    assert all(isinstance(t, Dataquery) for p in panels for t in p.targets)


def test_template_variables(committed):
    variables = {v["name"]: v for v in committed["templating"]["list"]}
    assert list(variables) == ["datasource", "kvgate", "engine"]
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    assert variables["kvgate"]["query"] == "label_values(agentic_kv_requests_total, instance)"
    assert variables["engine"]["query"] == "label_values(sglang:num_running_reqs, instance)"
    for name in ("kvgate", "engine"):
        v = variables[name]
        assert (v["type"], v["multi"], v["includeAll"], v["allValue"]) == ("query", True, True, ".*")
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_every_panel_has_a_one_line_description_and_uses_the_variables(committed):
    panels = [p for p in committed["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in committed["panels"]]
    assert len(set(ids)) == len(ids)
    for p in panels:
        desc = p.get("description", "")
        assert 40 <= len(desc) <= 240 and "\n" not in desc, (p["title"], desc)
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            expr = t["expr"]
            assert t["datasource"] == p["datasource"]
            # every query is filtered by an instance variable; every range vector uses $__rate_interval
            assert 'instance=~"$kvgate"' in expr or 'instance=~"$engine"' in expr, (p["title"], expr)
            assert re.findall(r"\[([^\]]+)\]", expr) == ["$__rate_interval"] * expr.count("["), expr
            metrics = set(re.findall(r"\b(agentic_kv_\w+|sglang:\w+)", expr))
            assert metrics, expr


def test_rows_cover_the_issue():
    titles = {row.title: [p.title for p in row.panels] for row in dashboard.ROWS}
    exprs = " ".join(t.expr for p in dashboard.panels() for t in p.targets)
    for metric in ("agentic_kv_sessions{", "agentic_kv_session_close_total", "agentic_kv_session_close_failure_total",
                   "agentic_kv_session_id_injected_total", "agentic_kv_admission_admit_total",
                   "agentic_kv_admission_wait_total", "agentic_kv_admission_bypass_total",
                   "agentic_kv_admission_defer_rate", "agentic_kv_admission_degraded_rate",
                   "agentic_kv_admission_waiting", "agentic_kv_admission_wait_seconds_bucket",
                   "agentic_kv_budget_ceiling_tokens", "agentic_kv_budget_reserved_tokens",
                   "agentic_kv_budget_reserved_utilization",
                   "agentic_kv_budget_lease_count", "agentic_kv_budget_epoch", "agentic_kv_budget_degraded",
                   "sglang:token_usage", "sglang:num_running_reqs", "sglang:num_queue_reqs",
                   "sglang:cached_tokens_total", "sglang:evicted_tokens_total",
                   "sglang:num_retracted_requests_total", "agentic_kv_requests_total",
                   "agentic_kv_proxy_added_seconds_bucket", "agentic_kv_programs{",
                   "agentic_kv_program_pauses_total", "agentic_kv_program_resumes_total",
                   "agentic_kv_program_waiting_resume", "agentic_kv_admission_backfilled_total",
                   "agentic_kv_program_pausing", "agentic_kv_program_reprefill_ratio",
                   "agentic_kv_program_pause_foresight"):
        assert metric in exprs, metric
    assert "by (source)" in exprs  # named vs inferred: any future source shows up as its own series
    # available: the fleet's one ceiling less every worker's and replica's own reservations (each worker's
    # agentic_kv_budget_available_tokens is the ceiling less its own alone: summed, it would count the ceiling
    # once per worker)
    budget = {t.legend: t.expr for p in dashboard.panels() if p.title == "Token budget" for t in p.targets}
    assert budget["available"] == f"{budget['ceiling']} - {budget['reserved']}"
    assert budget["ceiling"].startswith("max(") and budget["reserved"].startswith("sum(")
    assert list(titles) == ["Sessions", "Admission", "Budget", "Programs", "Engines", "Proxy"]


def test_substitute_expands_variables_as_grafana_does():
    expr = 'rate(x{instance=~"$engine", k=~"$kvgate"}[$__rate_interval])'
    assert dashboard.substitute(expr, {"engine": None, "kvgate": None}, "5m") == \
        'rate(x{instance=~".*", k=~".*"}[5m])'
    assert dashboard.substitute(expr, {"engine": ["127.0.0.1:1", "h:2"], "kvgate": ["a.b:3"]}, "1m") == \
        'rate(x{instance=~"(127\\\\.0\\\\.0\\\\.1:1|h:2)", k=~"a\\\\.b:3"}[1m])'


def test_queries_walks_collapsed_rows_too():
    d = {"panels": [{"type": "row", "title": "r", "panels": [{"title": "in", "targets": [{"refId": "A",
                                                                                         "expr": "up"}]}]},
                    {"title": "out", "targets": [{"refId": "B", "expr": "x"}, {"refId": "C"}]}]}
    assert dashboard.queries(d) == [("in", "A", "up"), ("out", "B", "x")]


def test_cli_writes_the_dashboard(tmp_path):
    _sdk()
    out = tmp_path / "d.json"
    assert dashboard.main(["--out", str(out)]) == 0
    assert out.read_text() == DASHBOARD.read_text()
