"""The engine directory's log lines when the router's health verdict on an engine changes."""

import logging

from kvgate.fleet.directory import EngineDirectory
from kvgate.fleet.discovery import Engine
from kvgate.common.metrics import Metrics

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


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
