"""The /metrics merge of several worker processes (pure), the restart back-off and the ``workers`` key."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.config import ConfigError, cpu_count, validate
from kvgate.common.metrics import Metrics
from kvgate.proxy.process_metrics import merge_expositions
from kvgate.proxy.processes import RESTART_MAX_DELAY_S, restart_delay


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}


def _worker(requests: int, inflight: int, active_sessions: int, latency_s: float) -> str:
    m = Metrics()
    for _ in range(requests):
        m.relayed("/generate", "200", latency_s)
    m.relayed("/health", "503", 0.001)
    m.inflight_now = inflight
    m.sessions.labels("active").set(active_sessions)
    m.session_close.labels("idle").inc()
    return m.render()[0].decode()


def test_counters_and_histograms_are_summed_gauges_are_per_worker_or_summed():
    a, b = _worker(3, 2, 5, 0.003), _worker(4, 1, 7, 0.2)
    m = _samples(merge_expositions([("0", a), ("1", b)], configured=2, restarts={"1": 3}))
    assert m[("agentic_kv_requests_total", (("route", "/generate"), ("status", "200")))] == 7
    assert m[("agentic_kv_requests_total", (("route", "/health"), ("status", "503")))] == 2
    assert m[("agentic_kv_session_close_total", (("reason", "idle"),))] == 2
    lat = {dict(k[1])["le"]: v for k, v in m.items()
           if k[0] == "agentic_kv_upstream_latency_seconds_bucket" and dict(k[1])["route"] == "/generate"}
    assert lat["0.005"] == 3 and lat["0.25"] == 7 and lat["+Inf"] == 7
    assert m[("agentic_kv_upstream_latency_seconds_count", (("route", "/generate"),))] == 7
    assert m[("agentic_kv_upstream_latency_seconds_sum", (("route", "/generate"),))] == pytest.approx(0.809)
    assert m[("agentic_kv_inflight_requests", ())] == 3  # a count of each process's own work: summed
    # a worker's own view of sessions (the same session can be known to both): one series per worker
    assert m[("agentic_kv_sessions", (("state", "active"), ("worker", "0")))] == 5
    assert m[("agentic_kv_sessions", (("state", "active"), ("worker", "1")))] == 7
    assert ("agentic_kv_sessions", (("state", "active"),)) not in m
    assert m[("agentic_kv_workers", ())] == 2
    assert m[("agentic_kv_worker_up", (("worker", "0"),))] == 1 == m[("agentic_kv_worker_up", (("worker", "1"),))]
    assert m[("agentic_kv_worker_requests_total", (("worker", "0"),))] == 4
    assert m[("agentic_kv_worker_requests_total", (("worker", "1"),))] == 5
    assert m[("agentic_kv_worker_restarts_total", (("worker", "0"),))] == 0
    assert m[("agentic_kv_worker_restarts_total", (("worker", "1"),))] == 3


def test_created_timestamps_take_the_earliest():
    a = ('# HELP x_total a counter\n# TYPE x_total counter\nx_total 1.0\n'
         '# HELP x_created a counter\n# TYPE x_created gauge\nx_created 200.0\n')
    b = a.replace("x_total 1.0", "x_total 2.0").replace("200.0", "100.0")
    m = _samples(merge_expositions([("0", a), ("1", b)]))
    assert m[("x_total", ())] == 3 and m[("x_created", ())] == 100


def test_a_worker_that_did_not_answer_is_down_and_left_out():
    a = _worker(3, 1, 2, 0.01)
    m = _samples(merge_expositions([("0", a), ("1", None), ("2", a)], configured=3))
    assert m[("agentic_kv_worker_up", (("worker", "1"),))] == 0
    assert ("agentic_kv_worker_requests_total", (("worker", "1"),)) not in m
    assert m[("agentic_kv_requests_total", (("route", "/generate"), ("status", "200")))] == 6
    assert ("agentic_kv_sessions", (("state", "active"), ("worker", "1"))) not in m


def test_one_worker_merged_is_its_own_figures_plus_the_worker_series():
    a = _worker(2, 1, 1, 0.01)
    own, merged = _samples(a.encode()), _samples(merge_expositions([("0", a)]))
    for (name, labels), value in own.items():
        if (name, labels) in merged:  # counters, histograms, summed gauges, _created
            assert merged[(name, labels)] == value, name
        else:  # a gauge of the worker's own view: now labelled with the worker
            assert merged[(name, tuple(sorted((*labels, ("worker", "0")))))] == value, name
    assert len(merged) == len(own) + 3  # up, requests and restarts of worker 0 (workers: not configured here)


def test_restart_delay_backs_off_a_crash_loop_and_forgets_it_after_a_long_life():
    assert restart_delay(0.0, 3600.0) == 0.0
    d = 0.0
    seen = []
    for _ in range(8):
        d = restart_delay(d, 0.5)
        seen.append(d)
    assert seen[0] == 0.25 and seen[1] == 0.5 and seen[-1] == RESTART_MAX_DELAY_S
    assert restart_delay(RESTART_MAX_DELAY_S, 60.0) == 0.0


def test_workers_key():
    assert validate({}).workers == 1
    assert validate({"workers": "auto", "state_backend": "redis"}).workers == cpu_count()
    assert validate({"workers": "3", "state_backend": "redis"}).workers == 3  # as a flag gives it
    assert validate({"workers": 1, "state_backend": "memory"}).workers == 1
    for raw, message in (({"workers": 0}, "workers: must be a positive integer or auto, got 0"),
                         ({"workers": True}, "workers: must be a positive integer or auto, got True"),
                         ({"workers": [2]}, "workers: expected an integer or a string, got [2]"),
                         ({"workers": 2}, "workers: 2 worker processes need state_backend: redis")):
        with pytest.raises(ConfigError) as err:
            validate(raw)
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
