"""One /metrics for several worker processes on one port (``workers: N``): the merge rule (pure).

Each worker renders its own Prometheus text; the worker a scrape lands on fetches its siblings' and
answers the merge, so a scrape of the shared port shows the whole process set whichever worker the
kernel picked. Parsing and rendering are prometheus_client's (its text parser and ``generate_latest``).

The rule, per metric family:
  - counters, histograms, summaries: summed sample by sample (the fleet's totals: requests, latencies);
  - ``*_created`` (a counter's creation time, exposed as its own gauge family): the earliest;
  - gauges whose meaning is a count of this process's own work (``SUMMED_GAUGES``: requests in flight,
    waiting, close calls pending): summed;
  - every other gauge (a worker's own view: its session registry, its ledger's budget, flags): one
    series per worker with a ``worker`` label, since adding views of the same sessions or the same
    ceiling would count them several times.
Added series: ``agentic_kv_workers`` (configured), ``agentic_kv_worker_up{worker}`` (answered this
scrape), ``agentic_kv_worker_requests_total{worker}`` (requests each worker relayed, the sum of its
``agentic_kv_requests_total``) and ``agentic_kv_worker_restarts_total{worker}`` (times the supervisor
restarted that worker slot). A worker that did not answer is missing from the sums for that scrape.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

#: Gauges that count a process's own work: the fleet's figure is the sum over the workers.
SUMMED_GAUGES = frozenset({
    "agentic_kv_inflight_requests",
    "agentic_kv_admission_waiting",
    "agentic_kv_session_close_pending",
    "agentic_kv_program_waiting_resume",
    "agentic_kv_program_waiting_bound",
    "agentic_kv_program_seats_kept",
})
WORKER_LABEL = "worker"
_SUMMED_TYPES = ("counter", "histogram", "summary", "gaugehistogram")


class _Families:
    """A collector that yields fixed families (for generate_latest)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def merge_expositions(parts: Sequence[tuple[str, str | None]], configured: int | None = None,
                      restarts: dict[str, int] | None = None) -> bytes:
    """Merge the Prometheus text expositions of several worker processes into one.

    ``parts``: (worker label, its exposition text, or None when it did not answer), in worker order;
    ``configured``: the ``workers`` setting (None: not added); ``restarts``: worker label -> times its slot
    was restarted. Returns the merged exposition (bytes, Prometheus text format 0.0.4). Raises ValueError
    when a text does not parse (the caller answers with what it has).
    """
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple, float]] = {}
    order: dict[str, list[tuple]] = {}
    per_worker_requests: list[tuple[str, float]] = []
    for worker, text in parts:
        if text is None:
            continue
        requests = 0.0
        for fam in text_string_to_metric_families(text):
            if fam.name not in merged:
                merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                values[fam.name], order[fam.name] = {}, []
            kind = _kind(fam)
            vals, keys = values[fam.name], order[fam.name]
            for s in fam.samples:
                labels = dict(s.labels)
                if kind == "label":
                    labels[WORKER_LABEL] = worker
                key = (s.name, tuple(sorted(labels.items())))
                if key not in vals:
                    vals[key] = s.value
                    keys.append(key)
                elif kind == "min":
                    vals[key] = min(vals[key], s.value)
                else:
                    vals[key] += s.value
                if s.name == "agentic_kv_requests_total":
                    requests += s.value
        per_worker_requests.append((worker, requests))
    families: list[Metric] = []
    for name, fam in merged.items():
        for sname, labels in order[name]:
            fam.add_sample(sname, dict(labels), values[name][(sname, labels)])
        families.append(fam)
    families.extend(_worker_families(parts, per_worker_requests, configured, restarts or {}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


def _kind(fam: Metric) -> str:
    """How a family's samples from several workers combine: sum, min or label (one series per worker)."""
    if fam.type in _SUMMED_TYPES:
        return "sum"
    if fam.name.endswith("_created"):
        return "min"
    if fam.name in SUMMED_GAUGES:
        return "sum"
    return "label"


def _worker_families(parts: Sequence[tuple[str, str | None]], requests: Iterable[tuple[str, float]],
                     configured: int | None, restarts: dict[str, int]) -> list[Metric]:
    out: list[Metric] = []
    if configured is not None:
        g = GaugeMetricFamily("agentic_kv_workers", "Worker processes configured (workers)")
        g.add_metric([], configured)
        out.append(g)
    up = GaugeMetricFamily("agentic_kv_worker_up", "1 when the worker process answered this scrape",
                           labels=[WORKER_LABEL])
    for worker, text in parts:
        up.add_metric([worker], 0 if text is None else 1)
    out.append(up)
    c = CounterMetricFamily("agentic_kv_worker_requests", "Requests relayed by each worker process (the sum of "
                            "its agentic_kv_requests_total)", labels=[WORKER_LABEL])
    for worker, n in requests:
        c.add_metric([worker], n)
    out.append(c)
    r = CounterMetricFamily("agentic_kv_worker_restarts", "Times the supervisor restarted a worker process "
                            "that exited", labels=[WORKER_LABEL])
    for worker, _ in parts:
        r.add_metric([worker], restarts.get(worker, 0))
    out.append(r)
    return out


__all__ = ["SUMMED_GAUGES", "WORKER_LABEL", "merge_expositions"]
