"""What a new user trips on first: the command line, config warnings, kvgate's own 404/405, a session id the
response header cannot carry as it is, and the rooms importing downward."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import aiohttp
import pytest

from kvgate.cli import build_parser, main
from kvgate.config import ConfigError, from_args, validate
from kvgate.proxy.relay import header_safe

ROOT = Path(__file__).resolve().parent.parent


# --- the command line ---------------------------------------------------------------------------------

def _parse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[1] == f"(every option: {err[0].partition(': error')[0]} --help)", err
    return err[0]


def test_an_abbreviated_flag_is_refused_with_the_flag_meant(capsys):
    assert _parse_error(["serve", "--por", "8080"], capsys) == (
        "kvgate serve: error: unrecognized arguments: --por 8080 (--por: did you mean --port?)")
    assert _parse_error(["serve", "--agentic-sesion-lifecycle"], capsys) == (
        "kvgate serve: error: unrecognized arguments: --agentic-sesion-lifecycle (--agentic-sesion-lifecycle: "
        "did you mean --agentic-session-lifecycle or --no-agentic-session-lifecycle?)")
    assert _parse_error(["serve", "--session-placment", "kvgate"], capsys).endswith(
        "(--session-placment: did you mean --session-placement or --session-placement-routes?)")
    assert _parse_error(["check-config", "--upstream=http://h:1", "--discovery-intervl-s=3"], capsys) == (
        "kvgate check-config: error: unrecognized arguments: --discovery-intervl-s=3 (--discovery-intervl-s: "
        "did you mean --discovery-interval-s?)")
    assert _parse_error(["sim-engine", "--max-total-num-token", "5"], capsys).endswith(
        "(--max-total-num-token: did you mean --max-total-num-tokens?)")
    # a word of a longer flag: the flags that hold it
    assert _parse_error(["serve", "--lifecycle"], capsys).endswith(
        "(--lifecycle: did you mean --agentic-session-lifecycle or --no-agentic-session-lifecycle?)")
    # a mistyped command
    assert _parse_error(["sever"], capsys).endswith("(did you mean serve?)")
    # nothing close: no hint; the full flag still works
    assert _parse_error(["serve", "--zzz"], capsys) == "kvgate serve: error: unrecognized arguments: --zzz"
    assert build_parser().parse_args(["serve", "--port", "8080"]).port == "8080"


def test_help_shows_every_flags_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("(0 picks a free port). (default: 8080)", "(default: http://127.0.0.1:30000)",
                 "(default: [body, header, routing_key, field, rid])", "null = unused. (default: null)",
                 "(default: X-Session-ID)", "(default: 0.5)"):
        assert text in out, text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sim-engine", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "most requests decoding at once per DP rank; more wait for a later batch (default: 1024)" in out
    assert "(default: 1.0)" in out  # --speed: its help did not say it


# --- config warnings ------------------------------------------------------------------------------------

def _cfg(tmp_path, text: str, *flags: str):
    f = tmp_path / "kvgate.yaml"
    f.write_text(text)
    args = build_parser().parse_args(["check-config", str(f), *flags])
    args.config = args.config_file
    return from_args(args)


def test_a_key_given_twice_is_warned_about_with_its_lines(tmp_path):
    cfg = _cfg(tmp_path, "port: 8081\nhost: 127.0.0.1\nport: 8082\n")
    assert cfg.port == 8082
    assert cfg.warnings == [f"port: given twice in {tmp_path / 'kvgate.yaml'} (lines 1 and 3); the last value, "
                            f"8082, is used"]


def test_an_upstream_path_is_honoured_with_a_warning_and_an_api_path_refused(tmp_path):
    cfg = validate({"upstream": "http://127.0.0.1:30000/smg/"})
    assert cfg.upstream == "http://127.0.0.1:30000/smg"
    assert cfg.warnings == ["upstream: http://127.0.0.1:30000/smg has a path (/smg): every request goes to /smg + "
                            "its own path (/smg/v1/completions, /smg/generate) and engines are discovered at "
                            "/smg/workers; a router's base URL has no path (http://HOST:PORT)"]
    for url in ("http://127.0.0.1:30000/v1", "http://127.0.0.1:30000/v1/", "http://127.0.0.1:30000/x/generate"):
        with pytest.raises(ConfigError) as exc:
            validate({"upstream": url})
        assert str(exc.value).startswith(f"upstream: {url.rstrip('/')} ends in an API path")
    assert str(exc.value).endswith("so give its base URL (http://127.0.0.1:30000/x)")
    with pytest.raises(ConfigError) as exc:
        validate({"upstream": "http://127.0.0.1:30000/v1/chat/completions"})
    assert str(exc.value).endswith("(/v1/chat/completions); kvgate sends each request's own path (/v1/completions, "
                                   "/generate) to the router, so give its base URL (http://127.0.0.1:30000)")
    assert validate({"upstream": "http://127.0.0.1:30000"}).warnings == []


def test_settings_that_do_nothing_are_warned_about_and_defaults_never(tmp_path):
    assert validate({}).warnings == []
    example = _cfg(tmp_path, (ROOT / "configs" / "kvgate.yaml").read_text())
    assert example.warnings == []  # it sets every key, at its default
    cfg = validate({"placement_pressure_threshold": 0.7, "session_placement": "router",
                    "placement_reopen_hint_s": 60, "close_retries": 3, "redis_timeout_s": 1,
                    "agentic_admission_headroom": 0.5, "admission_poll_interval_s": 1})
    assert cfg.warnings == [
        "close_retries: set to 3, but it does nothing while agentic_session_lifecycle is off; "
        "--agentic-session-lifecycle would enable it",
        "redis_timeout_s: set to 1.0, but it does nothing while state_backend is memory; --state-backend redis would "
        "enable it",
        "session_placement: set to 'router', but it does nothing while agentic_session_lifecycle is off "
        "(session_placement: auto places sessions only with lifecycle on); --agentic-session-lifecycle would enable it",
        "placement_pressure_threshold: set to 0.7, but it does nothing while kvgate places no session traffic "
        "(agentic_session_lifecycle is off and no route has session_placement: kvgate); --agentic-session-lifecycle "
        "would enable it",
        "placement_reopen_hint_s: set to 60.0, but it does nothing while kvgate places no session traffic "
        "(agentic_session_lifecycle is off and no route has session_placement: kvgate); --agentic-session-lifecycle "
        "would enable it",
        "agentic_admission_headroom: set to 0.5, but it does nothing while agentic_program_admission is off; "
        "--agentic-program-admission would enable it",
        "admission_poll_interval_s: set to 1.0, but it does nothing while agentic_program_admission is off; "
        "--agentic-program-admission would enable it"]
    # kvgate places sessions (lifecycle off, placement kvgate): the placement keys and the KV poll matter
    placed = validate({"session_placement": "kvgate", "placement_pressure_threshold": 0.7,
                       "admission_poll_interval_s": 1, "session_header": "X-Run"})
    assert placed.warnings == []
    on = validate({"agentic_session_lifecycle": True, "session_inference": False,
                   "session_inference_block_tokens": 32, "session_idle_floor_s": 5,
                   "agentic_program_admission": True, "admission_pause_victim": "largest"})
    assert [w.split(":")[0] for w in on.warnings] == ["session_inference_block_tokens", "session_idle_floor_s",
                                                      "admission_pause_victim"]
    assert on.warnings[2].endswith("admission_policy is fifo (a program policy key); --admission-policy program would "
                                   "enable it")


def test_check_config_prints_the_warnings_and_answers_ok(tmp_path, capsys):
    f = tmp_path / "k.yaml"
    f.write_text("close_retries: 3\nclose_retries: 4\n")
    assert main(["check-config", str(f)]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"kvgate: config warning: close_retries: given twice in {f} (lines 1 and 2); the last value, 4, is used",
        "kvgate: config warning: close_retries: set to 4, but it does nothing while agentic_session_lifecycle is off; "
        "--agentic-session-lifecycle would enable it"]
    assert out.startswith(f"{f}: ok")


# --- kvgate's own paths -----------------------------------------------------------------------------------

async def test_unknown_kvgate_paths_and_methods_get_kvgates_own_404_and_405(kvgate_factory, echo_upstream):
    for server in ("kvgate", "aiohttp"):
        gw, url = await kvgate_factory(upstream=echo_upstream.url, http_server=server, agentic_session_lifecycle=True)
        before = len(echo_upstream.received)
        async with aiohttp.ClientSession() as http:
            async with http.delete(url + "/kvgate/sessions/x") as r:
                assert (r.status, r.headers["Allow"]) == (405, "GET, HEAD"), server
                assert (await r.json())["error"]["message"] == (
                    "DELETE is not allowed on /kvgate/sessions/x; allowed: GET, HEAD")
            async with http.get(url + "/kvgate/sessions/x/close") as r:
                assert (r.status, r.headers["Allow"]) == (405, "POST")
            async with http.post(url + "/kvgate/health") as r:
                assert (r.status, r.headers["Allow"]) == (405, "GET, HEAD")
            async with http.get(url + "/kvgate/nothing") as r:
                assert r.status == 404
                assert (await r.json())["error"]["message"].startswith(
                    "kvgate has no endpoint /kvgate/nothing; its endpoints: /kvgate/engines, /kvgate/health")
            async with http.get(url + "/kvgate/health") as r:
                assert r.status == 200
            async with http.get(url + "/kvgatex") as r:  # not kvgate's: the router's
                assert (await r.json())["path"] == "/kvgatex"
        assert [x["path"] for x in echo_upstream.received[before:]] == ["/kvgatex"], server


async def test_a_hashed_session_id_is_found_under_the_id_kvgate_returned(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url, agentic_session_lifecycle=True, session_inference=False)
    sid = "sessión-☃"
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", json={"session_id": sid, "input_ids": [1, 2, 3]}) as r:
            told = r.headers["X-Kvgate-Session-Id"]
        assert told == header_safe(sid) and told.startswith("sha256:")
        async with http.get(url + f"/kvgate/sessions/{told}") as r:
            assert r.status == 200
            s = await r.json()
        assert (s["session_id"], s["turns"]) == (sid, 1)
        async with http.post(url + f"/kvgate/sessions/{told}/close") as r:
            assert (await r.json())["session_id"] == sid
    assert gw.lifecycle.registry.get(sid).close_reason == "admin_api"


# --- the house ----------------------------------------------------------------------------------------

LOWER_ROOMS = ("admission", "sessions", "fleet", "shared", "common")


def _kvgate_imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return [m for m in out if m == "kvgate" or m.startswith("kvgate.")]


def test_no_room_below_proxy_imports_from_it():
    """Every import in admission/, sessions/, fleet/, shared/ and common/ (at module level or inside a
    function) names no kvgate.proxy module; common imports no other room of kvgate."""
    bad = []
    for room in LOWER_ROOMS:
        for f in sorted((ROOT / "kvgate" / room).rglob("*.py")):
            for m in _kvgate_imports(f):
                if m.startswith("kvgate.proxy") or (room == "common" and not m.startswith(("kvgate.common",))
                                                    and m != "kvgate"):
                    bad.append(f"{f.relative_to(ROOT)}: {m}")
    assert bad == []
    assert _kvgate_imports(ROOT / "kvgate" / "proxy" / "app.py")  # the walk does find imports


# --- log lines once per change ------------------------------------------------------------------------

async def test_the_probes_line_is_said_once_while_the_router_stays_down(caplog):
    from kvgate.common.metrics import Metrics
    from kvgate.fleet.directory import EngineDirectory
    from kvgate.tools.procs import free_port
    d = EngineDirectory(f"http://127.0.0.1:{free_port()}", [], 0.05, Metrics())
    with caplog.at_level(logging.INFO, logger="kvgate.fleet.directory"):
        for _ in range(5):
            await d.refresh()
            await d.check_compat()
    await d.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert len([ln for ln in lines if "session_id" in ln]) == 1, lines
    assert len([ln for ln in lines if "unreachable" in ln]) == 1, lines
    assert d.probes == 5


def test_health_adds_up_its_checks():
    from kvgate.fleet.health import Check, Reachability, engines_check, summarize
    ok, bad = Check("router", True, "answers"), Check("router", False, "unreachable (refused)")
    assert summarize([ok, Check("engines", True)]) == ("ok", 200, [])
    assert summarize([bad, Check("engines", True)]) == ("down", 503, ["router: unreachable (refused)"])
    assert summarize([ok, Check("engines", None)]) == ("starting", 503, ["engines: not known yet"])
    some = engines_check([("http://a", True, None), ("http://b", False, "(the router reports it unhealthy)")],
                         True, None)
    assert summarize([ok, some]) == ("degraded", 200, [
        "engines: 1 of 2 engines unusable: http://b (the router reports it unhealthy)"])
    assert summarize([ok, engines_check([("http://b", False, "(x)")], True, None)])[:2] == ("down", 503)
    assert summarize([ok, engines_check([], True, None)])[2] == ["engines: the router lists no engine"]
    # the router not reached: no engine list is no news of the engines
    assert engines_check([], True, None, router_reached=False).reason == \
        "no engine known: the router was not reached (see the router check)"
    # the router answers, but not with a list kvgate reads: it still serves
    assert summarize([ok, engines_check([], True, "DiscoveryError: /workers answered 404")])[:2] == ("degraded", 200)
    r = Reachability()
    assert [r.note(True, None, 0), r.note(False, "refused", 1), r.note(False, "refused", 2), r.note(True, None, 3),
            r.note(True, None, 4)] == [None, "down", None, "up", None]
    assert (r.since, r.failures) == (3, 0)


async def test_the_routers_502s_are_logged_once_per_change(kvgate_factory, scripted, caplog):
    answer = {"status": 502}
    up = (await scripted(lambda r: f"HTTP/1.1 {answer['status']} X\r\nContent-Length: 1\r\n\r\nx".encode())).url
    gw, url = await kvgate_factory(upstream=up, discovery_interval_s=60)
    with caplog.at_level(logging.INFO, logger="kvgate.fleet.directory"):
        async with aiohttp.ClientSession() as http:
            statuses = []
            for status in (502, 502, 503, 200, 200, 502):
                answer["status"] = status
                async with http.post(url + "/v1/completions", data=b"{}") as r:
                    statuses.append(r.status)
    assert statuses == [502, 502, 503, 200, 200, 502]
    lines = [r.getMessage() for r in caplog.records if "forwarded calls" in r.getMessage() or "again (after" in
             r.getMessage()]
    assert lines == [f"router {up} answers 502 to forwarded calls (it cannot reach an engine); said again when "
                     f"it answers otherwise", f"router {up} answers 200 again (after 502)",
                     f"router {up} answers 502 to forwarded calls (it cannot reach an engine); said again when "
                     f"it answers otherwise"]


def test_health_says_down_only_when_no_call_can_be_served():
    """Over random router states, placed routes and engine sets: the status is down exactly when kvgate can serve
    no call (the router unreachable with nothing placed or no engine usable, or no engine usable at all), degraded
    when only some calls can be served, and the router check's figures are the ones given."""
    from hypothesis import given, settings, strategies as st
    from kvgate.fleet.health import Reachability, engines_check, router_check, summarize

    routes = st.lists(st.sampled_from(["/generate", "/v1/chat/completions", "/v1/completions"]), unique=True)

    @settings(max_examples=300, deadline=None)
    @given(router=st.sampled_from([True, False]), placed=routes, usable=st.lists(st.booleans(), min_size=1,
           max_size=4), answered=st.integers(0, 10 ** 6), since=st.floats(0, 10 ** 4))
    def check(router, placed, usable, answered, since):
        r = Reachability()
        r.note(router, None if router else "ClientConnectorError: refused", 0.0)
        engines = [(f"http://e{i}", ok, None if ok else "(x)") for i, ok in enumerate(usable)]
        n = sum(usable)
        rc = router_check(r, "http://router", since, placed, n, answered)
        status, code, reasons = summarize([rc, engines_check(engines, True, None)])
        served = n > 0 and (router or bool(placed))
        assert (status == "down") == (not served) and (code == 503) == (status == "down")
        if served and not router:
            assert status == "degraded" and reasons[0].startswith("router: http://router unreachable (")
            assert f"({n} usable, {answered} calls answered since)" in reasons[0]
            assert all(route in reasons[0] for route in placed)
            j = rc.as_json()
            assert (j["usable_engines"], j["placed_calls_answered"], j["placed_routes"], j["failures"]) == (
                n, answered, placed, 1)
            assert j["since_s"] == round(since, 3)
        if router and all(usable):
            assert (status, reasons) == ("ok", [])

    check()
