"""First contact, mended: an upstream that is no router says so (health, one log line), the command line takes
a config file as ``check-config`` does and answers a mistyped flag in one line, a port in use is said before
kvgate talks to anyone, and what the help and the docs say is true."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import aiohttp
import pytest

from kvgate.fleet.health import Check, engines_check, summarize

ROOT = Path(__file__).resolve().parent.parent


# --- an upstream that is not a router --------------------------------------------------------------------

def test_an_upstream_that_lists_no_engines_is_down_unless_it_is_an_engine():
    ok = Check("router", True, "answers")
    error = "DiscoveryError: /workers answered 404, /list_workers answered 404"
    status, code, reasons = summarize([ok, engines_check([], True, error, "other")])
    assert (status, code) == ("down", 503)
    assert reasons == [f"engines: the upstream is not an SGLang router ({error}, and no engine's /server_info): "
                       "forwarded calls fail (is it the router's Prometheus port?)"]
    status, code, reasons = summarize([ok, engines_check([], True, error, "engine")])
    assert (status, code) == ("degraded", 200)
    assert reasons == [f"engines: the upstream is an SGLang engine, not a router ({error}): list the engines under "
                       "engines: in the config"]
    # an answer kvgate cannot read (not asked what the upstream is) stays degraded; a known list wins
    assert summarize([ok, engines_check([], True, error)])[:2] == ("degraded", 200)
    assert summarize([ok, engines_check([("http://a", True, None)], True, error, "other")])[0] == "degraded"


async def _health(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/kvgate/health") as r:
            return r.status, await r.json()


async def test_the_routers_prometheus_port_as_upstream_is_down_with_the_reason(kvgate_factory, log_dir, caplog):
    """smg 1.13's Prometheus port answers 404 to everything but /metrics: every forwarded call would get a
    404, so kvgate's health says down, and one log line says why."""
    from kvgate.tools import procs
    if not procs.smg_installed():
        pytest.skip("the smg router is not installed (pip install smg)")
    port, mport = procs.free_port(), procs.free_port()
    smg = procs.start("smg", procs.smg_command(port, [], mport), log_dir)
    try:
        await asyncio.to_thread(procs.wait_http, f"http://127.0.0.1:{mport}/metrics", 60, smg)
        caplog.set_level(logging.INFO, logger="kvgate")
        gw, url = await kvgate_factory(upstream=f"http://127.0.0.1:{mport}", discovery_interval_s=60)
        status, h = await _health(url)
        assert (status, h["status"]) == (503, "down")
        assert h["reasons"] == [
            "engines: the upstream is not an SGLang router (DiscoveryError: /workers answered 404, /list_workers "
            "answered 404, and no engine's /server_info): forwarded calls fail (is it the router's Prometheus "
            "port?)"]
        lines = [r.getMessage() for r in caplog.records if "is not an SGLang router" in r.getMessage()]
        assert lines == [f"engine discovery: upstream http://127.0.0.1:{mport} is not an SGLang router: /workers answered 404, "
                         "/list_workers 404, and it does not answer an engine's /server_info (is it the router's "
                         "Prometheus port?)"]
        await gw.directory.refresh()  # asked again: said once per failure streak
        assert len([r for r in caplog.records if "is not an SGLang router" in r.getMessage()]) == 1
    finally:
        smg.stop()


async def test_an_engine_as_upstream_gets_a_hint_to_list_it_under_engines(kvgate_factory, sim_factory, caplog):
    eng = await sim_factory()
    caplog.set_level(logging.INFO, logger="kvgate")
    gw, url = await kvgate_factory(upstream=eng.url, discovery_interval_s=60)
    status, h = await _health(url)
    assert (status, h["status"]) == (200, "degraded")
    assert h["reasons"][0].startswith("engines: the upstream is an SGLang engine, not a router")
    lines = [r.getMessage() for r in caplog.records if "is an SGLang engine" in r.getMessage()]
    assert lines == [f"engine discovery: upstream {eng.url} is an SGLang engine, not a router (it answers /server_info but not "
                     f"/workers): list the engines in the config's engines: (--engines {eng.url}) and kvgate sends "
                     "to them without a router, or start the router in front of them"]
    # as the line says: with the engine listed, kvgate serves it without a router, and health is ok
    gw2, url2 = await kvgate_factory(upstream=eng.url, engines=[eng.url], discovery_interval_s=60)
    status, h = await _health(url2)
    assert (status, h["status"]) == (200, "ok"), h


# --- kvgate's own Redis client ------------------------------------------------------------------------------

def test_the_redis_client_is_built_without_a_warning():
    """redis-py converts a synchronous Retry given to its asyncio client, with a UserWarning per client."""
    import warnings
    from kvgate.common.metrics import Metrics
    from kvgate.shared.redis_state import SharedState
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        client = SharedState("redis://127.0.0.1:1", "kvgate:", 60, 1.0, Metrics()).client
    assert client.connection_pool.connection_kwargs["retry"].get_retries() == 0  # still no client-side retries


# --- what the docs and the help say ---------------------------------------------------------------------------

def test_docs_and_code_cite_no_file_outside_the_repository():
    """No path from a developer's machine, and no note that is not in the repository (the reference notes on
    the router, the SGLang engine, SGLang on CPU and program scheduling, and the shared traces, lived beside the
    checkout, not in it): a docstring names the public source (the paper, the SGLang file) instead."""
    found = []
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*")), *sorted((ROOT / "kvgate").rglob("*.py")),
             *sorted(p for p in (ROOT / "tests").rglob("*.py") if p.name != Path(__file__).name),
             *sorted((ROOT / "scripts").rglob("*")), *sorted((ROOT / "configs").rglob("*"))]
    for path in paths:
        if path.is_file() and path.suffix in (".md", ".py", ".json", ".yaml", ".yml", ".sh"):
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if re.search(r"/work/|router-compat|sglang-engine-api|program-scheduling|sglang-cpu\.md"
                             r"|reference notes?\b|\.\./shared", line):
                    found.append(f"{path.relative_to(ROOT)}:{n}")
    assert found == []


def test_session_placements_help_says_what_auto_does(capsys):
    from kvgate.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert ("auto (kvgate on every generate route when session lifecycle or admission is on, else the router), "
            "kvgate (always kvgate, even with both off) or router") in out
    assert "drops session_id" not in out


# --- the command line ----------------------------------------------------------------------------------------

def _kvgate(*argv, timeout=120):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "kvgate", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.mark.parametrize("http_server", ["kvgate", "aiohttp"])
def test_a_port_in_use_is_said_before_kvgate_talks_to_the_router(http_server):
    import socket
    taken, router = socket.socket(), socket.socket()
    for s in (taken, router):
        s.bind(("127.0.0.1", 0))
        s.listen()
    router.setblocking(False)
    port, rport = taken.getsockname()[1], router.getsockname()[1]
    try:
        res = _kvgate("serve", "--port", str(port), "--upstream", f"http://127.0.0.1:{rport}", "--http-server",
                      http_server)
        assert res.returncode == 2, res.stderr
        assert res.stderr.strip().splitlines() == [
            f"kvgate: startup error: cannot listen on 127.0.0.1:{port} (Address already in use): another "
            f"process listens there: stop it, or choose another --port"]
        with pytest.raises(BlockingIOError):
            router.accept()  # kvgate never connected to the router (a connect would sit in its accept queue)
    finally:
        taken.close()
        router.close()


def test_serve_takes_the_config_file_as_check_config_does(tmp_path):
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    f = tmp_path / "x.yaml"
    f.write_text(f"port: {port}\nupstream: http://127.0.0.1:9\n")
    try:
        assert _kvgate("check-config", str(f)).returncode == 0
        res = _kvgate("serve", str(f))  # read: it names the file's port, which is taken
        assert (res.returncode, res.stderr.strip().splitlines()) == (2, [
            f"kvgate: startup error: cannot listen on 127.0.0.1:{port} (Address already in use): another "
            f"process listens there: stop it, or choose another --port"])
        res = _kvgate("serve", str(f), "--config", str(tmp_path / "y.yaml"))
        assert (res.returncode, res.stderr.splitlines()) == (2, [
            f"kvgate serve: error: two config files: {f} and --config {tmp_path / 'y.yaml'}",
            "(every option: kvgate serve --help)"])
    finally:
        taken.close()


def test_a_mistyped_flag_gets_one_line_and_the_way_to_the_rest():
    res = _kvgate("serve", "--upstrem", "http://127.0.0.1:9")
    assert (res.returncode, res.stdout, res.stderr.splitlines()) == (2, "", [
        "kvgate serve: error: unrecognized arguments: --upstrem http://127.0.0.1:9 (--upstrem: did you mean "
        "--upstream?)", "(every option: kvgate serve --help)"])


def test_the_readme_stays_within_120_lines_and_names_the_commands_that_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 120
    from kvgate.cli import build_parser
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in re.findall(r"`kvgate ([a-z-]+)", text):
        assert name in commands, name


async def test_a_router_answering_5xx_to_workers_is_not_called_no_router(kvgate_factory, scripted, caplog):
    """A router that is starting or failing answers /workers with 503: that is not "no router" (down), and no
    hint is logged; only paths that do not exist (404, 405) are."""
    from fake_upstream import response
    up = await scripted(lambda r: response(503, b"starting"), answers_discovery=False)  # /workers included
    caplog.set_level(logging.INFO, logger="kvgate")
    gw, kv = await kvgate_factory(upstream=up.url, discovery_interval_s=60)
    status, h = await _health(kv)
    assert (status, h["status"]) == (200, "degraded")
    assert h["reasons"] == ["engines: engine discovery failed (DiscoveryError: /workers answered 503, "
                            "/list_workers answered 503) and no engine is known"]
    assert gw.directory.upstream_kind is None
    assert not [r for r in caplog.records if "SGLang" in r.getMessage()]


def test_tests_share_one_raw_fake_upstream():
    """A raw-socket upstream is fake_upstream.ScriptedUpstream (the ``scripted`` fixture), not a loop of a test
    module's own (netgate.py is a proxy that cuts connections, not an upstream)."""
    own = [p.name for p in sorted((ROOT / "tests").rglob("*.py"))
           if p.name not in ("fake_upstream.py", "netgate.py", Path(__file__).name)
           and "asyncio.start_server(" in p.read_text()]
    assert own == []


def test_kvgate_reads_no_private_name_of_a_library():
    """Every ``x._name`` in kvgate/ (x not self or cls) names an attribute kvgate defines itself: a private name
    of aiohttp, asyncio or any other library is an internal that may change in any release (aiohttp's
    ``Payload._value``, ``TCPSite._server`` were read once). Known and documented exceptions are listed."""
    import ast
    allowed = {"_exit",  # os._exit: public, documented
               "_value_",  # Enum's documented sunder name
               "_actions", "_SubParsersAction"}  # argparse has no public way to list a parser's actions
    files = sorted((ROOT / "kvgate").rglob("*.py"))
    trees = {p: ast.parse(p.read_text()) for p in files}
    own: set[str] = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                own.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
        for n in ast.walk(tree):  # slotted and dataclass fields: annotated names in class bodies
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                own.add(n.target.id)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("_"):
                own.add(n.value)  # __slots__ entries
    found = []
    for p, tree in trees.items():
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                    and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
                    and n.attr not in own and n.attr not in allowed):
                found.append(f"{p.relative_to(ROOT)}:{n.lineno} {ast.unparse(n)}")
    assert found == []
