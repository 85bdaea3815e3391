"""kvgate's own Prometheus series (prometheus-client), all prefixed ``agentic_kv_``.

One registry per running app (not the process-global one), so tests can run several kvgates.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

# Generations run for minutes: latency buckets reach 20 minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200)
# kvgate's own added time before forwarding is sub-millisecond when healthy.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class _Count:
    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class _LoopSeries:
    """What LoopCounter and LoopHistogram share: a child per label values (str), made on first use."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]):
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str):
        """The child for ``values`` (one per label name; ValueError otherwise): one dict lookup once made."""
        c = self._children.get(values)
        if c is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(self.labelnames)} label values needed, got {values!r}")
            c = self._children[values] = self._new_child()
        return c

    def _new_child(self):
        raise NotImplementedError


class LoopCounter(_LoopSeries):
    """A counter written on every request: a child's ``inc()`` is one addition (the event loop is the only
    writer: no lock) and ``labels()`` one dict lookup. prometheus-client's Counter takes a lock per
    increment and builds a key per ``labels()``. Exported at scrape time (``collect``) as that Counter would
    be: ``NAME_total`` and ``NAME_created`` for each label set."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...], registry: CollectorRegistry):
        super().__init__(name, documentation, labelnames)
        registry.register(self)  # last: the registry reads the series at once

    def _new_child(self) -> _Count:
        return _Count()

    def collect(self):
        """The counter family, for the registry at scrape time."""
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, c in list(self._children.items()):
            fam.add_metric(values, c.value, created=c.created)
        yield fam


class _Buckets:
    __slots__ = ("counts", "sum", "created", "_bounds")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, amount)] += 1  # le is inclusive: the first bound >= amount
        self.sum += amount


class LoopHistogram(_LoopSeries):
    """A histogram written on every request, without a lock (see LoopCounter): ``labels(*values).observe(x)``
    (or ``observe(x)`` without labels; x in the buckets' unit, seconds here) finds the bucket with one C
    bisect. Exported at scrape time as prometheus-client's Histogram would be: cumulative ``NAME_bucket{le}``,
    ``NAME_count``, ``NAME_sum`` and ``NAME_created``."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...], buckets: tuple[float, ...],
                 registry: CollectorRegistry):
        super().__init__(name, documentation, labelnames)
        self._bounds = tuple(sorted(float(b) for b in buckets if b != float("inf")))
        self._plain = self.labels() if not self.labelnames else None
        registry.register(self)  # last: the registry reads the series at once

    def _new_child(self) -> _Buckets:
        return _Buckets(self._bounds)

    def observe(self, amount: float) -> None:
        """Observe ``amount`` on a histogram without labels."""
        self._plain.observe(amount)

    def collect(self):
        """The histogram family, for the registry at scrape time."""
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        for values, c in list(self._children.items()):
            acc, cumulative = 0, []
            for le, n in zip(les, c.counts):
                acc += n
                cumulative.append((le, acc))
            fam.add_metric(values, cumulative, c.sum)
            fam.samples.append(Sample(self.name + "_created", dict(zip(self.labelnames, values)), c.created))
        yield fam


class Metrics:
    """Every series kvgate exports. ``render()`` returns (body bytes, content type) for GET /metrics."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._relayed: dict[tuple[str, str], tuple] = {}
        self._children: dict[tuple, object] = {}
        p = "agentic_kv_"
        # proxy
        # The series every request writes are LoopCounter / LoopHistogram: no lock, no key built per request.
        self.requests = LoopCounter(p + "requests", "Requests relayed, by route and upstream status "
                                    "(status 'error' = no upstream answer)", ("route", "status"), registry=r)
        self.upstream_latency = LoopHistogram(p + "upstream_latency_seconds", "Time from forwarding a request "
                                              "to the last byte relayed back", ("route",), LATENCY_BUCKETS, r)
        self.added_latency = LoopHistogram(p + "proxy_added_seconds", "kvgate's own time before forwarding "
                                           "(classify, resolve session; admission queue wait excluded)", (),
                                           OVERHEAD_BUCKETS, r)
        self.inflight = Gauge(p + "inflight_requests", "Requests being relayed now", registry=r)
        # Counted in a plain int (no lock per request), read at scrape time.
        self.inflight_now = 0
        self.inflight.set_function(lambda: self.inflight_now)
        self.upstream_errors = Counter(p + "upstream_errors", "Upstream failures answered by kvgate "
                                       "(unreachable, timeout) or cut mid-response", ["kind"], registry=r)
        self.client_disconnects = Counter(p + "client_disconnects", "Clients gone before their response "
                                          "ended; the upstream request was cancelled", registry=r)
        self.faults = Counter(p + "faults", "Faults in kvgate's own logic; the request went out unchanged",
                              ["stage"], registry=r)
        self.state_backend_up = Gauge(p + "state_backend_up", "1 while the shared state backend (Redis) "
                                      "answers, 0 while each replica goes on with its own state", registry=r)
        self.state_backend_bypass = Counter(p + "state_backend_bypass", "Shared-state calls not made or "
                                            "failed because Redis was unreachable; the decision used this "
                                            "replica's own state (fail-open), by op", ["op"], registry=r)
        self.state_backend_calls = Counter(p + "state_backend_calls", "Batched calls sent to the shared state "
                                           "backend (Redis): each carries the writes queued meanwhile", registry=r)
        self.state_backend_ops = Counter(p + "state_backend_ops", "Writes (and grants, idle claims) those calls "
                                         "carried; ops / calls is the batching", registry=r)
        self.body_features_skipped = Counter(p + "body_features_skipped", "Generate calls relayed untouched "
                                             "without kvgate's body features (session id, inference, admission "
                                             "estimate), by why: content_encoding (sent compressed), size (over "
                                             "body_parse_max_bytes), session_id_size (a session id over "
                                             "max_session_id_bytes)", ["reason"], registry=r)
        # sessions
        self.lifecycle_enabled = Gauge(p + "session_lifecycle_enabled", "1 when session lifecycle is on",
                                       registry=r)
        self.session_id_injected = LoopCounter(p + "session_id_injected", "Generate calls sent with a "
                                               "session_id, by where it came from", ("source",), r)
        self.session_params_skipped = Counter(p + "session_params_skipped", "Generate calls left without "
                                              "session_id because they use session_params", registry=r)
        self.sessions = Gauge(p + "sessions", "Sessions in the registry, by state", ["state"], registry=r)
        self.sessions_dropped = Gauge(p + "sessions_dropped", "Sessions dropped from the registry by its cap",
                                      registry=r)
        self.session_close = Counter(p + "session_close", "Sessions closed, by reason", ["reason"], registry=r)
        self.session_close_failure = Counter(p + "session_close_failure", "Engine /close_session calls that "
                                             "failed (connect error, timeout, HTTP error); each is retried "
                                             "until close_retries are used up", registry=r)
        self.close_calls = Counter(p + "session_close_calls", "Engine /close_session calls, by result (ok, error)",
                                   ["result"], registry=r)
        self.close_call_latency = Histogram(p + "session_close_call_seconds", "Time of one /close_session call "
                                            "to one engine", buckets=OVERHEAD_BUCKETS + LATENCY_BUCKETS[-10:],
                                            registry=r)
        self.session_close_pending = Gauge(p + "session_close_pending", "Engine closes not delivered yet, by "
                                           "state (sending: a call is out; pending: waiting for a retry)",
                                           ["state"], registry=r)
        self.session_close_retries = Counter(p + "session_close_retries", "Engine /close_session calls sent "
                                             "again after a failure", registry=r)
        self.session_close_given_up = Counter(p + "session_close_given_up", "Engine closes given up (retries "
                                              "used up, or a 4xx); asking to close again re-arms them", registry=r)
        self.session_close_dropped = Counter(p + "session_close_dropped", "Engine closes dropped without another "
                                             "try, by why (engine_gone: the router no longer lists the engine)",
                                             ["reason"], registry=r)
        self.session_close_cancelled = Counter(p + "session_close_cancelled", "Engine closes dropped because "
                                               "the session came back before they were delivered", registry=r)
        self.session_reopened = Counter(p + "session_reopened", "Requests that re-opened a closing or closed "
                                        "session", registry=r)
        self.session_aborts = Counter(p + "session_aborts", "Session turns that ended in an abort, by cause "
                                      "(client: /abort_request named its rid, closes the session; other: a "
                                      "weight update, flush, memory release or engine fault, a step boundary)",
                                      ["cause"], registry=r)
        self.session_retractions = Counter(p + "session_retractions", "Times the engines retracted a session's "
                                           "turn for lack of KV (its decode recomputed), from each answer's "
                                           "meta_info.num_retractions", registry=r)
        self.session_close_skipped = Counter(p + "session_close_skipped", "Closes not fanned out, by why (no_kv: "
                                             "the session's KV went with a cache flush; elsewhere: another replica "
                                             "closes it)", ["reason"], registry=r)
        self.session_inference = Counter(p + "session_inference", "Generate calls without a named session, by what "
                                         "prefix inference found (decisive, partial, rerender, prompt-only, new, "
                                         "new-ambiguous, unsupported; retry: the same prompt as its session's turn in flight; shared: a turn "
                                         "another replica relayed; refused: the upstream refused the call, no turn)",
                                         ["result"], registry=r)
        self.inference_tracked = Gauge(p + "session_inference_tracked", "Sessions tracked by prefix inference",
                                       registry=r)
        self.inference_dropped = Gauge(p + "session_inference_dropped", "Sessions dropped by the inference cap",
                                       registry=r)
        self.idle_threshold = Gauge(p + "session_idle_threshold_seconds", "Idle time after which a session is "
                                    "closed (adaptive mode: learned from the gaps between turns)", registry=r)
        self.step = Gauge(p + "step", "Training steps seen: cache flushes and weight updates relayed by kvgate",
                          registry=r)
        self.close_latency = Histogram(p + "session_close_fanout_seconds", "Time from a close to every "
                                       "engine having it (drain and retries included)", buckets=LATENCY_BUCKETS, registry=r)
        # engines and compatibility
        self.engines = Gauge(p + "engines", "Engines known, by worker type", ["worker_type"], registry=r)
        self.discovery_failures = Counter(p + "discovery_failures", "Failed engine discovery refreshes "
                                          "(the last good list is kept)", registry=r)
        self.discovery_last_success = Gauge(p + "discovery_last_success_unixtime", "When engine discovery "
                                            "last succeeded", registry=r)
        self.passthrough = Gauge(p + "router_session_id_passthrough", "1 on the probe's verdict per generate "
                                 "route: does the router forward top-level session_id to the engines",
                                 ["route", "verdict"], registry=r)
        self.placement_active = Gauge(p + "session_placement_active", "1 when kvgate places the route's session "
                                      "traffic on engines itself (0: the router picks)", ["route"], registry=r)
        self.placements = Counter(p + "session_placements", "Sessions placed on an engine by kvgate, by engine "
                                  "and why (free_kv, prefix, reopened, replaced)", ["engine", "reason"], registry=r)
        self.placed_sessions = Gauge(p + "placed_sessions", "Active sessions kvgate placed, by engine",
                                     ["engine"], registry=r)
        self.placement_calls = LoopCounter(p + "placement_calls", "Session calls on a placed route, by where "
                                           "they went (engine; router_fallback: no engine usable; connect_retry: "
                                           "an engine refused the connection and the next was tried; "
                                           "router_auth: the call lacked the router's API key, so the router "
                                           "answered it; in a prefill/decode fleet, decode_named: smg decoded it on "
                                           "the decode worker kvgate named, decode_name_ignored: on another, "
                                           "decode_name_refused: smg refused the name and the call went again "
                                           "unnamed, decode_unnamed: sent unnamed while naming is off)",
                                           ("outcome",), r)
        self.engine_warning = Gauge(p + "engine_warning", "1 when an engine is misconfigured for kvgate",
                                    ["engine", "kind"], registry=r)

        # admission (the counters and budget gauges are read from the core at scrape time: admission/gate.py;
        # so are the program policy's agentic_kv_programs{engine,state}, agentic_kv_program_pauses_total{engine},
        # agentic_kv_program_resumes_total{engine}, agentic_kv_program_waiting_resume, and the resident bound's
        # agentic_kv_program_waiting_bound, agentic_kv_program_resident_bound_waits_total,
        # agentic_kv_program_seats_kept{engine})
        self.admission_wait = Histogram(p + "admission_wait_seconds", "Time requests waited in the admission "
                                        "FIFO before admit or bypass", buckets=LATENCY_BUCKETS, registry=r)

        # Known label values exist from the start at 0, so dashboards and alerts see a series before the
        # first event (a missing series and a zero rate are different things to Prometheus).
        for stage in ("session", "registry", "admission", "idle_sweep", "inference", "placement", "observer"):
            self.faults.labels(stage)
        for op in ("heartbeat", "turn", "idle", "placement", "inference", "admission", "capacity"):
            self.state_backend_bypass.labels(op)
        for reason in ("content_encoding", "size", "session_id_size"):
            self.body_features_skipped.labels(reason)
        for kind in ("unreachable", "timeout", "cut", "protocol_error"):
            self.upstream_errors.labels(kind)
        # client: its /close_session; admin_api: POST /kvgate/sessions/{id}/close; pause: the program policy
        # final: a final-turn marker (X-Session-Final); finish: /finish_session; parent: its parent session closed
        for reason in ("client", "admin_api", "idle", "abort", "pause", "final", "finish", "parent"):
            self.session_close.labels(reason)
        self.session_close_skipped.labels("no_kv")
        self.session_close_skipped.labels("elsewhere")
        self.session_close_dropped.labels("engine_gone")
        for outcome in ("engine", "router_fallback", "connect_retry", "router_auth", "decode_named",
                        "decode_name_ignored", "decode_name_refused", "decode_unnamed"):
            self.placement_calls.labels(outcome)
        for result in ("ok", "error"):
            self.close_calls.labels(result)
        for cause in ("client", "other"):
            self.session_aborts.labels(cause)
        for result in ("decisive", "partial", "rerender", "prompt-only", "reask", "retry", "new", "new-ambiguous",
                       "unsupported", "shared", "refused"):
            self.session_inference.labels(result)


    def child(self, metric, *values: str):
        """``metric.labels(*values)``, looked up once and kept (request-path counters: no key tuple, lock and
        dict lookup inside prometheus_client per request). Only for bounded label sets."""
        key = (id(metric), values)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*values)
        return c

    def relayed(self, route: str, status: str, elapsed_s: float) -> None:
        """Count one relayed request (route label, upstream status or error) and its upstream latency, seconds.

        The labelled children are looked up once per (route, status) and kept: a ``labels()`` call builds a
        key tuple and takes the metric's lock on every request. Both label sets are bounded (route_label's
        known routes, HTTP statuses), so the cache is too.
        """
        key = (route, status)
        children = self._relayed.get(key)
        if children is None:
            children = self._relayed[key] = (self.requests.labels(route, status),
                                             self.upstream_latency.labels(route))
        children[0].inc()
        children[1].observe(elapsed_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def set_passthrough(self, route: str, verdict: str) -> None:
        for v in ("forwarded", "dropped", "unknown"):
            self.passthrough.labels(route, v).set(1 if v == verdict else 0)
