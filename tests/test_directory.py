"""The engine directory's log lines when the router's health verdict on an engine changes."""

import logging

from kvgate.fleet.directory import EngineDirectory
from kvgate.fleet.discovery import Engine
from kvgate.common.metrics import Metrics

A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"


def test_an_engine_turning_unhealthy_and_back_is_logged_once_each(caplog):
    d = EngineDirectory("http://127.0.0.1:9", [], 5.0, Metrics())
    seen = []
    d.on_change.append(lambda engines: seen.append([e.healthy for e in engines]))
    d._set([Engine(A), Engine(B)])
    with caplog.at_level(logging.INFO, logger="kvgate.fleet.directory"):
        d._set([Engine(A), Engine(B, healthy=False)])
        d._set([Engine(A), Engine(B, healthy=False)])  # no change: no line
        d._set([Engine(A), Engine(B)])
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [("WARNING", f"engine {B}: the router reports it unhealthy"),
                     ("INFO", f"engine {B}: the router reports it healthy again")]
    assert seen == [[True, True], [True, False], [True, True]]


def test_with_the_router_unreachable_only_engines_a_placed_call_can_use_keep_kvgate_serving():
    """Router unreachable, kvgate placing calls: health is degraded while a regular engine is usable, down when
    the only usable engines are PD workers (kvgate places no call on them: every call needs the router)."""
    from kvgate.fleet.health import summarize
    d = EngineDirectory("http://127.0.0.1:9", [], 5.0, Metrics(), lifecycle_on=True,
                        placement_modes={"/generate": "auto"})
    d.first_refresh.set()
    d.router_result(False, "ClientConnectorError: refused")
    d._set([Engine(A, worker_type="prefill"), Engine(B, worker_type="decode")])
    router, _ = d.checks()
    assert summarize(d.checks())[:2] == ("down", 503) and router.detail["usable_engines"] == 0
    d._set([Engine(A), Engine(C, worker_type="prefill"), Engine(B, worker_type="decode")])
    router, _ = d.checks()
    assert summarize(d.checks())[:2] == ("degraded", 200) and router.detail["usable_engines"] == 1
    d.engine_call_failed(A, "refused a placed call's connection")
    assert summarize(d.checks())[:2] == ("down", 503)
