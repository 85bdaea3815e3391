"""The demo's summary reconciles: every printed sum adds up, and a figure that does not is named (pure)."""

from kvgate.tools.demo import CloseFigures, placement_line, reconcile, router_line


def _figures(**kw) -> CloseFigures:
    # 5 sessions on 2 engines; s1 went on after its idle close and was closed twice; s2's turns went to both
    # engines (round_robin); the rest were closed at the end through kvgate's API.
    base = dict(sessions=5, closed=5, closes={"idle": 3, "client": 0, "admin_api": 3, "abort": 0},
                session_closes=[2, 1, 1, 1, 1], engines=2, failed_calls=0, engine_closes=[6, 6],
                engine_sessions=[{"s0", "s1", "s2"}, {"s2", "s3", "s4"}])
    return CloseFigures(**{**base, **kw})


def test_figures_that_add_up():
    lines, off = reconcile(_figures())
    assert off == []
    assert lines[0] == ("sessions   5 in the trace window, 5 closed at the end; 6 closes (idle 3, client 0, "
                        "admin_api 3, abort 0) = 5 sessions + 1 closed again (they sent a turn after their idle close)")
    assert lines[1] == ("fan-out    12 /close_session calls = 6 closes x 2 engines: 12 ok, 0 failed; the engines "
                        "received 6 + 6 = 12")
    assert lines[2] == ("engines    session_id reached an engine for 5 sessions; per engine 3 + 3 = 6 (1 session had "
                        "turns on more than one engine: the router's policy does not keep a session on one engine)")


def test_failed_calls_are_subtracted():
    lines, off = reconcile(_figures(failed_calls=1, engine_closes=[6, 5]))
    assert "12 /close_session calls = 6 closes x 2 engines: 11 ok, 1 failed" in lines[1]
    assert off == []


def test_figures_that_do_not_add_up_are_named():
    _, off = reconcile(_figures(engine_closes=[6, 7], engine_sessions=[{"s0"}, {"s1"}], closed=4))
    assert off == ["1 session not closed at the end",
                   "the engines received 13 closes, kvgate made 12 successful calls",
                   "session_id reached the engines for 2 sessions, the trace window has 5"]
    _, off = reconcile(_figures(closes={"idle": 3, "client": 0, "admin_api": 4, "abort": 0}, engine_closes=[7, 7]))
    assert off == ["7 closes by reason, but the registry has 6 closes of 5 sessions"]


def test_sessions_on_several_engines_are_explained_by_who_placed_them():
    lines, off = reconcile(_figures(placed_by="kvgate"))
    assert off == []
    assert lines[2].endswith("(1 session had turns on more than one engine: re-opened after a close while their "
                             "engine was at the placement pressure threshold)")


def test_the_router_line_says_who_picked_the_engine_apart_from_what_the_probe_found():
    assert router_line("/generate", "forwarded", "kvgate") == (
        "router     turns sent to /generate; kvgate picked each session's engine and sent its turns there itself, "
        "past the router (session placement; the router served the other calls). kvgate's probe found the "
        "router forwards a top-level session_id on /generate")
    assert router_line("/v1/completions", "forwarded", "router") == (
        "router     turns sent to /v1/completions; the router picked each turn's engine (kvgate placed none). "
        "kvgate's probe found the router forwards a top-level session_id on /v1/completions, so the engine got "
        "each session's id")
    assert "could not tell" in router_line("/generate", "unknown", "router")


def test_the_placement_line_explains_each_count():
    counts = {"free_kv": 1, "prefix": 0, "reopened": 0, "replaced": 0, "sticky": 9, "reopen_elsewhere": 0}
    assert placement_line(counts) == (
        "placement  1 session placement (a session's first turn, or its first turn after a close or after its engine "
        "left): 1 on the engine with the most free KV, 0 with the engine holding their prompt's prefix, 0 re-opened "
        "on their old engine, 0 moved off an engine that left; of these, 0 re-opened elsewhere (their old engine at "
        "the pressure threshold); then 9 later turns went to their session's engine, where its prefix is cached")
    assert "then 1 later turn went" in placement_line({**counts, "sticky": 1})
