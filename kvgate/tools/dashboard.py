"""kvgate's Grafana dashboard, built from code with grafana-foundation-sdk (Grafana 11.6 types).

``python -m kvgate.tools.dashboard --out configs/grafana/kvgate.json`` writes the committed dashboard;
tests/test_dashboard.py checks that the committed file is what this module produces.
``python -m kvgate.tools.dashboard --check http://127.0.0.1:9090`` evaluates every panel query against a
live Prometheus (the dashboard's template variables set to "All") and prints the ones with no series.

The panels are declared as data (:data:`ROWS`) so the queries can be listed and checked without
Grafana; only :func:`build` needs the SDK (a dev/test dependency, not a runtime one).

Template variables: ``datasource`` (any Prometheus), ``kvgate`` (kvgate instances, from
``agentic_kv_requests_total``) and ``engine`` (engine instances, from ``sglang:num_running_reqs``).
SGLang engines may export identical per-TP-rank copies and one series per DP rank: engine queries
take the max over TP copies, then sum (or max) over DP ranks, per engine instance.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

UID = "kvgate"
TITLE = "kvgate"
KV = 'instance=~"$kvgate"'
EN = 'instance=~"$engine"'
RI = "$__rate_interval"

# Template variables that select instances: name -> (label_values metric, label, description).
INSTANCE_VARIABLES = {
    "kvgate": ("agentic_kv_requests_total", "instance", "kvgate instances (host:port of their /metrics)"),
    "engine": ("sglang:num_running_reqs", "instance", "SGLang engines (host:port of their /metrics)"),
}


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel and its legend."""

    expr: str
    legend: str = "__auto"


@dataclass(frozen=True)
class PanelSpec:
    """A panel: title, a one-line description (what a bad value means, what to check), queries."""

    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    width: int = 8
    min: float | None = 0
    max: float | None = None


@dataclass(frozen=True)
class RowSpec:
    """A dashboard row and its panels."""

    title: str
    panels: tuple[PanelSpec, ...] = field(default_factory=tuple)


def _q(metric: str, q: str, by: str = "le") -> str:
    """histogram_quantile of a kvgate histogram over the rate interval, aggregated ``by``."""
    return f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket{{{KV}}}[{RI}])))"


def _engine_sum(metric: str, rate: bool = False, extra_by: str = "") -> str:
    """Per engine: max over identical TP copies, then sum over DP ranks (and ``extra_by`` labels)."""
    inner = f"rate({metric}{{{EN}}}[{RI}])" if rate else f"{metric}{{{EN}}}"
    return f"sum by (instance) (max by (instance, dp_rank{extra_by}) ({inner}))"


def _quantiles(metric: str, by: str = "le", legend_prefix: str = "") -> tuple[Target, ...]:
    extra = by.replace("le", "").strip(", ")
    prefix = legend_prefix + ("{{" + extra + "}} " if extra else "")
    return tuple(Target(_q(metric, q, by), f"{prefix}p{int(q * 100)}") for q in (0.5, 0.9, 0.99))


ROWS: tuple[RowSpec, ...] = (
    RowSpec("Sessions", (
        PanelSpec("Sessions by state",
                  "Sessions in kvgate's registry (of several workers, the largest); active far above the rollout's "
                  "concurrency means closes are not arriving: check that the client ends sessions or that "
                  "session_idle_close_s is set.",
                  (Target(f"sum by (state) (max without (worker) (agentic_kv_sessions{{{KV}}}))", "{{state}}"),)),
        PanelSpec("Sessions closed per second, by reason",
                  "client = the client's /close_session, admin_api = /kvgate/sessions/{id}/close, idle = kvgate's "
                  "sweep, abort = an aborted turn; only idle closes: the rollout never closes sessions, KV stays "
                  "pinned until session_idle_close_s.",
                  (Target(f"sum by (reason) (rate(agentic_kv_session_close_total{{{KV}}}[{RI}]))", "{{reason}}"),),
                  unit="ops"),
        PanelSpec("Close failures and registry drops",
                  "Failed engine /close_session calls (retried with backoff), closes pending a retry or given up, "
                  "registry cap drops; pending that stays or any given up: check the engines' reachability.",
                  (Target(f"sum(rate(agentic_kv_session_close_failure_total{{{KV}}}[{RI}]))", "close failures/s"),
                   Target(f"sum(agentic_kv_session_close_pending{{{KV},state=\"pending\"}})", "pending retry"),
                   Target(f"sum(agentic_kv_session_close_given_up_total{{{KV}}})", "given up (total)"),
                   Target(f"sum(agentic_kv_sessions_dropped{{{KV}}})", "dropped by cap (total)"))),
        PanelSpec("Session id source (named vs inferred)",
                  "Generate calls sent with a session_id, by where it came from (body/header/field = named by the "
                  "client, inferred = kvgate guessed it); a falling total means the rollout stopped sending ids.",
                  (Target(f"sum by (source) (rate(agentic_kv_session_id_injected_total{{{KV}}}[{RI}]))",
                          "{{source}}"),
                   Target(f"sum(rate(agentic_kv_session_params_skipped_total{{{KV}}}[{RI}]))",
                          "skipped (session_params)")),
                  unit="reqps"),
        PanelSpec("Close fan-out latency",
                  "Time from a close to every engine having it (retries included); seconds or more means an "
                  "engine is slow or unreachable: check the close failures panel and the engines' health.",
                  _quantiles("agentic_kv_session_close_fanout_seconds"), unit="s"),
        PanelSpec("Router forwards session_id",
                  "The probe's verdict per generate route (forwarded/dropped/unknown); dropped means the router "
                  "strips session_id there, so kvgate places that route's session traffic on the engines itself "
                  "(session_placement: auto; see docs/placement.md).",
                  (Target(f"max by (route, verdict) (agentic_kv_router_session_id_passthrough{{{KV}}}) == 1",
                          "{{route}} {{verdict}}"),),
                  kind="stat"),
    )),
    RowSpec("Admission", (
        PanelSpec("Admission decisions per second",
                  "admit = leased at once, wait = queued first, bypass = let through unbudgeted; bypass-degraded "
                  "or aged rising means the KV signal is stale or the budget is too tight for the load.",
                  (Target(f"sum(rate(agentic_kv_admission_admit_total{{{KV}}}[{RI}]))", "admit"),
                   Target(f"sum(rate(agentic_kv_admission_wait_total{{{KV}}}[{RI}]))", "wait"),
                   Target(f"sum by (reason) (rate(agentic_kv_admission_bypass_total{{{KV}}}[{RI}]))",
                          "bypass {{reason}}"),
                   Target(f"sum(rate(agentic_kv_admission_cancelled_total{{{KV}}}[{RI}]))", "cancelled"),
                   Target(f"sum(rate(agentic_kv_admission_backfilled_total{{{KV}}}[{RI}]))", "backfilled")),
                  unit="reqps"),
        PanelSpec("Defer and degraded rate",
                  "Share of requests that waited (defer) or bypassed for a stale signal (degraded) over kvgate's "
                  "window; degraded > 0 means engine /v1/loads or /metrics is failing: check the engines row.",
                  (Target(f"max by (instance) (agentic_kv_admission_defer_rate{{{KV}}})", "defer {{instance}}"),
                   Target(f"max by (instance) (agentic_kv_admission_degraded_rate{{{KV}}})",
                          "degraded {{instance}}")),
                  unit="percentunit", max=1),
        PanelSpec("Requests waiting",
                  "Requests held in the admission FIFO now; a queue that never drains means the ceiling is too "
                  "low for the workload (agentic_admission_headroom) or leases are stranded (budget row).",
                  (Target(f"sum(agentic_kv_admission_waiting{{{KV}}})", "waiting"),)),
        PanelSpec("Admission wait time",
                  "Time spent in the FIFO before admit or bypass; p99 near agentic_admission_max_wait_s means "
                  "requests age out (bypass aged): raise headroom or lower the completion cap.",
                  _quantiles("agentic_kv_admission_wait_seconds"), unit="s", width=24),
    )),
    RowSpec("Budget", (
        PanelSpec("Token budget",
                  "ceiling = healthy engines' max_total_num_tokens x headroom (the fleet's), reserved = every "
                  "worker's leases; available near 0 with low engine usage means reservations overestimate: "
                  "check max_new_tokens and the decode cap.",
                  (Target(f"max(agentic_kv_budget_ceiling_tokens{{{KV}}})", "ceiling"),
                   Target(f"sum(agentic_kv_budget_reserved_tokens{{{KV}}})", "reserved"),
                   Target(f"max(agentic_kv_budget_ceiling_tokens{{{KV}}}) - "
                          f"sum(agentic_kv_budget_reserved_tokens{{{KV}}})", "available"))),
        PanelSpec("Reserved utilisation",
                  "reserved / ceiling, summed over a kvgate's workers; pinned at 1 while requests wait means the "
                  "budget is the bottleneck; "
                  "compare with engine token usage to tell a tight budget from a full KV pool.",
                  (Target(f"sum by (instance) (agentic_kv_budget_reserved_utilization{{{KV}}})", "{{instance}}"),),
                  unit="percentunit", max=1),
        PanelSpec("KV usage seen by admission",
                  "Fleet mean and worst-engine token_usage from kvgate's poller; if it differs from the engines "
                  "row, kvgate is reading stale or different engines: check /kvgate/engines.",
                  (Target(f"max by (instance) (agentic_kv_kv_token_usage_mean{{{KV}}})", "mean {{instance}}"),
                   Target(f"max by (instance) (agentic_kv_kv_token_usage_max{{{KV}}})", "max {{instance}}")),
                  unit="percentunit", max=1),
        PanelSpec("Leases",
                  "Live leases and leases reclaimed by TTL; expiries mean requests ended without release "
                  "(kvgate fault or killed client): check kvgate's log and the proxy row's disconnects.",
                  (Target(f"sum(agentic_kv_budget_lease_count{{{KV}}})", "live"),
                   Target(f"sum(rate(agentic_kv_budget_lease_expired_total{{{KV}}}[{RI}]))", "expired/s"))),
        PanelSpec("Budget epoch",
                  "Increments when the set of healthy engines changes; frequent changes mean engines flap: "
                  "check the engines' health and the router's worker list.",
                  (Target(f"max by (instance) (agentic_kv_budget_epoch{{{KV}}})", "{{instance}}"),),
                  kind="stat"),
        PanelSpec("Budget degraded",
                  "1 = no fresh KV figures, so every request bypasses admission; check that engines serve "
                  "/v1/loads or /metrics (--enable-metrics) and admission_poll_interval_s.",
                  (Target(f"max by (instance) (agentic_kv_budget_degraded{{{KV}}})", "{{instance}}"),),
                  kind="stat", max=1),
    )),
    # admission_policy: program only; "or on() vector(0)" keeps a flat 0 line under the fifo policy (and adds
    # nothing once a series exists: on() matches any).
    RowSpec("Programs", (
        PanelSpec("Programs per engine, by state",
                  "live = a turn in flight, in_tool = between turns, paused = held by kvgate; many paused for long "
                  "means the working set far exceeds the KV pool: more engines or fewer concurrent programs.",
                  (Target(f"sum by (engine, state) (agentic_kv_programs{{{KV}}}) or on() vector(0)",
                          "{{engine}} {{state}}"),), width=12),
        PanelSpec("Pauses and resumes per engine",
                  "Programs paused (their engine session closed) and resumed per second; pauses far above resumes "
                  "for long means programs end while paused or age out: check the aging bound and the TTL.",
                  (Target(f"sum by (engine) (rate(agentic_kv_program_pauses_total{{{KV}}}[{RI}])) or on() vector(0)",
                          "pause {{engine}}"),
                   Target(f"sum by (engine) (rate(agentic_kv_program_resumes_total{{{KV}}}[{RI}])) or on() vector(0)",
                          "resume {{engine}}")), width=12),
        PanelSpec("Paused turns waiting",
                  "Turns of paused programs held in kvgate now (never draining: the engines cannot hold one more "
                  "context); for a seat: turns waiting under admission_program_max_resident.",
                  (Target(f"sum(agentic_kv_program_waiting_resume{{{KV}}}) or on() vector(0)", "waiting"),
                   Target(f"sum(agentic_kv_program_waiting_bound{{{KV}}}) or on() vector(0)", "for a seat"))),
        PanelSpec("Own-prefix cache misses",
                  "Tokens of a live program's own context the engine no longer had cached at its next turn "
                  "(evicted during the tool call); rising means thrash: the program policy should pause sooner.",
                  (Target(f"sum(rate(agentic_kv_program_prefix_miss_tokens_total{{{KV}}}[{RI}])) or on() vector(0)",
                          "missed tokens/s"),)),
        PanelSpec("Pause gate",
                  "1 while the program policy holds turns and pauses programs: from the re-prefill ratio reaching "
                  "admission_pause_start_ratio or foresight admission_foresee_cycles; kvgate's log says when and why.",
                  (Target(f"max by (instance) (agentic_kv_program_pausing{{{KV}}}) or on() vector(0)",
                          "pausing {{instance}}"),
                   Target(f"max by (instance) (agentic_kv_program_reprefill_ratio{{{KV}}}) or on() vector(0)",
                          "re-prefill ratio {{instance}}"),
                   Target(f"max by (instance) (agentic_kv_program_pause_foresight{{{KV}}}) or on() vector(0)",
                          "foresight {{instance}} (program cycles)"))),
    )),
    RowSpec("Engines", (
        PanelSpec("KV token usage per engine",
                  "sglang:token_usage (worst DP rank); near 1 the engine evicts and retracts: expect admission to "
                  "hold work above agentic_admission_pressure_threshold, else check admission is on.",
                  (Target(f"max by (instance) (sglang:token_usage{{{EN}}})", "{{instance}}"),),
                  unit="percentunit", max=1),
        PanelSpec("Running requests per engine",
                  "Requests decoding now; very uneven across engines means sticky routing piles sessions on one "
                  "engine: check the router policy and session affinity.",
                  (Target(_engine_sum("sglang:num_running_reqs"), "{{instance}}"),)),
        PanelSpec("Queued requests per engine",
                  "Requests waiting inside the engine; a growing queue means the engine is KV- or compute-bound: "
                  "compare with token usage and kvgate's admission wait.",
                  (Target(_engine_sum("sglang:num_queue_reqs"), "{{instance}}"),)),
        PanelSpec("Prefix cache hit rate per engine",
                  "Cached / prompt tokens over the interval; a drop while sessions continue means their KV was "
                  "evicted between turns: check evictions and whether closes arrive.",
                  (Target(f"{_engine_sum('sglang:cached_tokens_total', rate=True)} / "
                          f"{_engine_sum('sglang:prompt_tokens_total', rate=True)}", "{{instance}}"),),
                  unit="percentunit", max=1),
        PanelSpec("Evicted tokens per second",
                  "KV tokens evicted from the radix cache; sustained eviction with high usage means the pool is "
                  "oversubscribed: lower headroom or close sessions sooner.",
                  (Target(_engine_sum("sglang:evicted_tokens_total", rate=True, extra_by=", cache_type"),
                          "{{instance}}"),)),
        PanelSpec("Retracted requests per second",
                  "Decodes retracted for lack of KV (their work is recomputed); any sustained value means the "
                  "pool runs out mid-decode: admission should be on and its budget smaller.",
                  (Target(_engine_sum("sglang:num_retracted_requests_total", rate=True), "{{instance}}"),
                   Target(f"sum(rate(agentic_kv_session_retractions_total{{{KV}}}[{RI}]))",
                          "session turns (kvgate, from the answers)")),
                  unit="reqps"),
        PanelSpec("Engines known to kvgate",
                  "Engines from the router's worker list by type; 0 or a drop means discovery fails: check the "
                  "router's /workers and the staleness panel.",
                  (Target(f"max by (worker_type) (agentic_kv_engines{{{KV}}})", "{{worker_type}}"),)),
        PanelSpec("Discovery staleness",
                  "Seconds since kvgate last refreshed the engine list; above a few discovery intervals means the "
                  "router is unreachable or its /workers fails (see discovery failures).",
                  (Target(f"time() - max by (instance) (agentic_kv_discovery_last_success_unixtime{{{KV}}})",
                          "{{instance}}"),
                   Target(f"sum(rate(agentic_kv_discovery_failures_total{{{KV}}}[{RI}]))", "failures/s")),
                  unit="s"),
        PanelSpec("Engine warnings",
                  "1 = an engine is misconfigured for kvgate (kind says how: session cache off, old SGLang, "
                  "/metrics 404); fix the engine's flags as the kind names, see /kvgate/engines.",
                  (Target(f'max by (engine, kind) (agentic_kv_engine_warning{{{KV}, engine=~"https?://$engine/?"}}) '
                          f'or on() vector(0)', "{{engine}} {{kind}}"),),
                  max=1),
    )),
    RowSpec("Proxy", (
        PanelSpec("Requests per second by route and status",
                  "Requests relayed; status error = no upstream answer, 5xx from the router or engines: check "
                  "upstream errors and the router's log.",
                  (Target(f"sum by (route, status) (rate(agentic_kv_requests_total{{{KV}}}[{RI}]))",
                          "{{route}} {{status}}"),),
                  unit="reqps", width=12),
        PanelSpec("kvgate added latency",
                  "kvgate's own time before forwarding (admission wait excluded); above a few ms means kvgate "
                  "is CPU-starved: check its CPU and the in-flight count.",
                  _quantiles("agentic_kv_proxy_added_seconds"), unit="s", width=12),
        PanelSpec("Upstream latency by route",
                  "Forward to last byte relayed, i.e. the router and engine time; rising with flat added latency "
                  "means the engines are the bottleneck: see the engines row.",
                  _quantiles("agentic_kv_upstream_latency_seconds", by="le, route"), unit="s"),
        PanelSpec("In-flight requests",
                  "Requests being relayed now; climbing without bound means upstream requests hang: check "
                  "read_timeout_s and the engines' queues.",
                  (Target(f"sum(agentic_kv_inflight_requests{{{KV}}})", "in flight"),)),
        PanelSpec("Upstream errors and client disconnects",
                  "Upstream unreachable/timeout/cut answered by kvgate, and clients gone mid-request; errors mean "
                  "the router is down or overloaded: check its health and connect_timeout_s.",
                  (Target(f"sum by (kind) (rate(agentic_kv_upstream_errors_total{{{KV}}}[{RI}]))", "{{kind}}"),
                   Target(f"sum(rate(agentic_kv_client_disconnects_total{{{KV}}}[{RI}]))", "client disconnects")),
                  unit="reqps"),
        PanelSpec("Shared state (Redis)",
                  "state_backend redis: replicas up, calls that fell back to a replica's own state, writes per "
                  "batched call; fall-backs above 0 mean Redis is down or slow: check redis_timeout_s and its latency.",
                  (Target(f"sum(agentic_kv_state_backend_up{{{KV}}})", "replicas on Redis"),
                   Target(f"sum by (op) (rate(agentic_kv_state_backend_bypass_total{{{KV}}}[{RI}]))",
                          "{{op}} fell back /s"),
                   Target(f"sum(rate(agentic_kv_state_backend_ops_total{{{KV}}}[{RI}])) / "
                          f"sum(rate(agentic_kv_state_backend_calls_total{{{KV}}}[{RI}]))", "writes per call"))),
        PanelSpec("kvgate internal faults",
                  "Faults in kvgate's own logic (the request went out unchanged: fail-open); anything above 0 is a "
                  "kvgate bug or a bad signal: read kvgate's log for the stage shown.",
                  (Target(f"sum by (stage) (increase(agentic_kv_faults_total{{{KV}}}[{RI}]))", "{{stage}}"),)),
    )),
)


def panels() -> list[PanelSpec]:
    """Every panel of the dashboard, in order."""
    return [p for row in ROWS for p in row.panels]


def build():
    """The dashboard as a grafana-foundation-sdk ``Dashboard`` model (needs the SDK installed)."""
    from grafana_foundation_sdk.builders import common as cb
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import prometheus as pb
    from grafana_foundation_sdk.builders import stat as sb
    from grafana_foundation_sdk.builders import timeseries as tb
    from grafana_foundation_sdk.models import common as cm
    from grafana_foundation_sdk.models import dashboard as dm

    ds = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
    d = (db.Dashboard(TITLE).uid(UID)
         .description("kvgate (session lifecycle, program-aware admission) next to the SGLang engines' KV figures")
         .tags(["kvgate", "sglang", "rl"]).editable().tooltip(dm.DashboardCursorSync.CROSSHAIR)
         .time("now-1h", "now").refresh("30s").timezone("browser"))
    d = d.with_variable(db.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    for name, (metric, label, desc) in INSTANCE_VARIABLES.items():
        d = d.with_variable(
            db.QueryVariable(name).label(name).description(desc).datasource(ds)
            .query(f"label_values({metric}, {label})")
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*")
            .current(dm.VariableOption(selected=True, text="All", value="$__all")))
    panel_id = 0
    for row in ROWS:
        panel_id += 1
        d = d.with_row(db.Row(row.title).id(panel_id).collapsed(False))
        for spec in row.panels:
            panel_id += 1
            if spec.kind == "stat":
                p = (sb.Panel().reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
                     .graph_mode(cm.BigValueGraphMode.AREA))
            else:
                p = (tb.Panel().legend(cb.VizLegendOptions().show_legend(True)
                                       .display_mode(cm.LegendDisplayMode.LIST)
                                       .placement(cm.LegendPlacement.BOTTOM))
                     .line_width(1).fill_opacity(10))
            p = (p.id(panel_id).title(spec.title).description(spec.description).datasource(ds)
                 .unit(spec.unit).height(8).span(spec.width))
            if spec.min is not None:
                p = p.min(spec.min)
            if spec.max is not None:
                p = p.max(spec.max)
            for i, t in enumerate(spec.targets):
                p = p.with_target(pb.Dataquery().ref_id(chr(ord("A") + i)).datasource(ds).expr(t.expr)
                                  .legend_format(t.legend).range())
            d = d.with_panel(p)
    return d.build()


def render() -> str:
    """The dashboard JSON exactly as committed in configs/grafana/kvgate.json (sorted keys, 2-space indent)."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    return JSONEncoder(sort_keys=True, indent=2).encode(build()) + "\n"


def spec_queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) for every query of :data:`ROWS` (what :func:`build` puts in the JSON)."""
    return [(p.title, chr(ord("A") + i), t.expr) for p in panels() for i, t in enumerate(p.targets)]


def queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) for every query target of a dashboard JSON object, rows included."""
    out = []
    stack = list(dashboard.get("panels", []))
    while stack:
        p = stack.pop(0)
        stack[:0] = p.get("panels", []) or []  # panels inside collapsed rows
        for t in p.get("targets", []) or []:
            if t.get("expr"):
                out.append((p.get("title", ""), t.get("refId", ""), t["expr"]))
    return out


def substitute(expr: str, variables: dict[str, list[str] | None], rate_interval: str) -> str:
    """Expand template variables as Grafana does for Prometheus: a multi-value variable becomes
    ``(v1|v2)`` with regex-escaped values; ``None`` (All) becomes the variable's all value ``.*``;
    ``$__rate_interval`` becomes ``rate_interval``."""
    def one(name: str) -> str:
        vals = variables[name]
        if vals is None:
            return ".*"
        escaped = [re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", v) for v in vals]
        return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"

    expr = expr.replace("$__rate_interval", rate_interval)
    for name in sorted(variables, key=len, reverse=True):
        expr = re.sub(r"\$\{" + name + r"\}|\$" + name + r"\b", lambda _m, n=name: one(n), expr)
    return expr


def prom_query(prom_url: str, expr: str, timeout_s: float = 10.0) -> dict:
    """GET /api/v1/query?query=expr on a Prometheus; returns the decoded JSON (status, data or error)."""
    url = prom_url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:  # 400/422 carry Prometheus's error JSON
        return json.loads(exc.read() or b'{"status": "error", "error": "empty body"}')


def check(prom_url: str, qs: list[tuple[str, str, str]], variables: dict[str, list[str] | None] | None = None,
          rate_interval: str = "5m") -> list[tuple[str, str, str, str]]:
    """Evaluate queries ``qs`` ((panel, refId, expr), see :func:`queries`) on ``prom_url``; return
    (panel, refId, substituted expr, problem) for each query that errs or returns no series.
    ``variables`` maps template variable names to values (None = All, the dashboard's default)."""
    variables = variables or {name: None for name in INSTANCE_VARIABLES}
    problems = []
    for title, ref, expr in qs:
        q = substitute(expr, variables, rate_interval)
        ans = prom_query(prom_url, q)
        if ans.get("status") != "success":
            problems.append((title, ref, q, f"error: {ans.get('errorType')}: {ans.get('error')}"))
        elif not ans["data"]["result"]:
            problems.append((title, ref, q, "no series"))
    return problems


def main(argv: list[str] | None = None) -> int:
    """CLI: write the dashboard JSON (--out) and/or check its queries against a Prometheus (--check)."""
    ap = argparse.ArgumentParser(prog="python -m kvgate.tools.dashboard", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the dashboard JSON here ('-' = stdout)")
    ap.add_argument("--check", metavar="PROMETHEUS_URL", help="evaluate every panel query on this Prometheus")
    ap.add_argument("--rate-interval", default="5m", help="value for $__rate_interval in --check (default 5m)")
    args = ap.parse_args(argv)
    if not args.out and not args.check:
        args.out = "-"
    if args.out:
        text = render()
        if args.out == "-":
            sys.stdout.write(text)
        else:
            Path(args.out).write_text(text)
    if args.check:
        qs = spec_queries()
        try:
            problems = check(args.check, qs, rate_interval=args.rate_interval)
        except (OSError, ValueError) as exc:  # URLError is an OSError; ValueError: not JSON
            print(f"kvgate.tools.dashboard: cannot query Prometheus at {args.check}: {exc}", file=sys.stderr)
            return 2
        for title, ref, q, problem in problems:
            print(f"{title} [{ref}]: {problem}: {q}", file=sys.stderr)
        print(f"{len(qs) - len(problems)}/{len(qs)} queries returned series", file=sys.stderr)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
