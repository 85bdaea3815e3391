"""Every query of the Grafana dashboard, evaluated by a real Prometheus scraping a live fleet.

Two simulated engines (in-process) behind a real smg router, kvgate in-process with session lifecycle and
admission on, and Debian's prometheus binary on 127.0.0.1 (own process group, temp storage, 1 s scrapes)
configured from configs/prometheus/prometheus.yml. A short load creates sessions, closes one, makes
requests wait and bypass, and ends with an upstream error (the router stopped). Then every panel query
of configs/grafana/kvgate.json goes through /api/v1/query with the template variables substituted, once
as "All" and once with the instances Prometheus lists; any error or empty result fails the test.

Without the prometheus binary the test skips, except under CI=true, where it fails (scripts/setup.sh
installs it).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
from datetime import datetime
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml

from kvgate.tools import dashboard
from kvgate.tools import procs

pytestmark = pytest.mark.router

ROOT = Path(__file__).resolve().parent.parent
PROM_CONFIG = ROOT / "configs" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "configs" / "grafana" / "kvgate.json"
SCRAPE_S = 1
RATE_INTERVAL = "1m"  # covers the whole run; Grafana would use max(4 x scrape interval, step + scrape)


def _require(found: str | None, what: str) -> str:
    """The path of a needed executable; skip without it, but fail under CI (setup.sh installs it)."""
    if found is None:
        reason = f"{what} is not installed (scripts/setup.sh installs it)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def _prometheus() -> str | None:
    return shutil.which("prometheus") or ("/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK)
                                          else None)


def _promtool() -> str | None:
    return shutil.which("promtool") or ("/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK) else None)


def test_committed_prometheus_config_is_valid():
    promtool = _require(_promtool(), "promtool (Debian package prometheus)")
    out = subprocess.run([promtool, "check", "config", str(PROM_CONFIG)], check=False, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr
    jobs = {j["job_name"] for j in yaml.safe_load(PROM_CONFIG.read_text())["scrape_configs"]}
    assert jobs == {"kvgate", "sglang"}


def _prometheus_config(kvgate: str, engines: list[str]) -> dict:
    """The committed config with this fleet's targets and a 1 s scrape interval (everything else kept)."""
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    cfg["global"].update(scrape_interval=f"{SCRAPE_S}s", scrape_timeout=f"{SCRAPE_S}s",
                         evaluation_interval=f"{SCRAPE_S}s")
    targets = {"kvgate": [kvgate], "sglang": engines}
    for job in cfg["scrape_configs"]:
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    return cfg


def _hostport(url: str) -> str:
    return url.split("://", 1)[1].rstrip("/")


def _parse_ts(s: str) -> float:
    """Prometheus's RFC 3339 times carry nanoseconds; Python takes microseconds."""
    s = re.sub(r"(\.\d{6})\d+", r"\1", s).replace("Z", "+00:00")
    return datetime.fromisoformat(s).timestamp()


def _scraped_after(t: float, n_targets: int):
    """A procs.wait_http predicate on /api/v1/targets: n targets, all up, each scraped after time t."""
    def ok(status: int, body: bytes) -> bool:
        if status != 200:
            return False
        active = json.loads(body)["data"]["activeTargets"]
        return len(active) == n_targets and all(
            a["health"] == "up" and _parse_ts(a["lastScrape"]) > t for a in active)
    return ok


def _query(prom: str, expr: str) -> list[dict]:
    ans = dashboard.prom_query(prom, expr)
    assert ans["status"] == "success", (expr, ans)
    return ans["data"]["result"]


def _values(result: list[dict], label: str) -> dict[str, float]:
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in result}


async def _generate(http, kv: str, n_prompt: int, max_new: int, first: int, headers: dict) -> tuple[int, str]:
    body = {"input_ids": list(range(first, first + n_prompt)),
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}
    async with http.post(kv + "/generate", data=orjson.dumps(body),
                         headers={"Content-Type": "application/json", **headers}) as r:
        await r.read()
        return r.status, r.headers.get("X-Kvgate-Admission", "")


async def test_every_dashboard_query_returns_series_from_a_real_prometheus(sim_factory, kvgate_factory, log_dir):
    prom_bin = _require(_prometheus(), "prometheus (Debian package prometheus)")
    _require("smg" if procs.smg_installed() else None, "the smg router (pip install smg)")
    started: list[procs.Proc] = []
    try:
        # Fleet: two engines of 2,000 tokens (the second with the session cache off -> an engine warning),
        # a real smg router, kvgate with lifecycle and admission on (ceiling 2 x 2,000 x 0.9 = 3,600).
        e1 = await sim_factory(max_total_num_tokens=2000, speed=4.0)
        e2 = await sim_factory(max_total_num_tokens=2000, speed=4.0, enable_session_radix_cache=False)
        port, mport = procs.free_port(), procs.free_port()
        router = procs.start("router", procs.smg_command(port, [e1.url, e2.url], mport), log_dir,
                             url=f"http://127.0.0.1:{port}")
        started.append(router)
        await asyncio.to_thread(procs.wait_http, router.url + "/readiness", 60, router, procs.router_ready(2))
        gw, kv = await kvgate_factory(upstream=router.url, agentic_session_lifecycle=True,
                                      agentic_program_admission=True, admission_poll_interval_s=0.1,
                                      discovery_interval_s=0.2, compat_probe=True,
                                      session_placement="router")  # the 502 below needs the router path
        await gw.directory.compat_checked.wait()
        while gw.gate.ledger.snapshot is None or gw.gate.ledger.ceiling == 0:
            await gw.poller.round_done.wait()
        assert gw.gate.ledger.ceiling == 3600
        assert [k for k, _ in gw.directory.warnings[e2.url]] == ["session_radix_cache_off"]

        # Prometheus on 127.0.0.1, its own process group, temp storage; scraping before the load starts.
        prom_port = procs.free_port()
        prom_dir = log_dir / "prometheus"
        prom_dir.mkdir()
        cfg_path = prom_dir / "prometheus.yml"
        cfg_path.write_text(yaml.safe_dump(_prometheus_config(_hostport(kv), [_hostport(e1.url),
                                                                               _hostport(e2.url)])))
        prom = procs.start("prometheus", [prom_bin, f"--config.file={cfg_path}",
                                          f"--storage.tsdb.path={prom_dir / 'data'}",
                                          f"--web.listen-address=127.0.0.1:{prom_port}",
                                          "--storage.tsdb.retention.time=1h", "--log.level=warn"],
                           log_dir, url=f"http://127.0.0.1:{prom_port}")
        started.append(prom)
        await asyncio.to_thread(procs.wait_http, prom.url + "/-/ready", 30, prom)
        await asyncio.to_thread(procs.wait_http, prom.url + "/api/v1/targets", 30, prom,
                                _scraped_after(0.0, 3))

        # Load: 9 sessions of 500 reserved tokens each (7 fit in 3,600: the rest wait), a second turn of two
        # sessions, a protected request (bypass), one session closed by the API and one by /close_session,
        # then the router stopped and one more request (upstream unreachable -> 502).
        async with aiohttp.ClientSession() as http:
            first = await asyncio.gather(*(_generate(http, kv, 100, 400, 1000 * i + 1, {"X-Session-ID": f"s{i}"})
                                           for i in range(9)),
                                         _generate(http, kv, 20, 20, 50_001, {"X-Session-ID": "p",
                                                                              "X-Kvgate-Protected": "1"}))
            assert [s for s, _ in first] == [200] * 10
            assert [d for _, d in first] == ["admit"] * 9 + ["bypass-protected"]
            second = await asyncio.gather(*(_generate(http, kv, 150, 50, 1000 * i + 1, {"X-Session-ID": f"s{i}"})
                                            for i in range(2)))
            assert [s for s, _ in second] == [200, 200]
            async with http.post(kv + "/kvgate/sessions/s3/close?wait=1") as r:
                assert r.status == 200 and (await r.json())["state"] == "closed"
            async with http.post(kv + "/close_session", json={"session_id": "s4"}) as r:
                assert r.status == 200
            router.stop()
            status, _ = await _generate(http, kv, 10, 10, 60_001, {"X-Session-ID": "late"})
            assert status == 502
        counters = gw.gate.coord.counters
        assert counters["wait"] >= 2 and counters["bypass_protected"] == 1
        t_load_end = time.time()

        # Synchronise on Prometheus: two scrapes of every target after the load (no fixed sleep).
        await asyncio.to_thread(procs.wait_http, prom.url + "/api/v1/targets", 30, prom,
                                _scraped_after(t_load_end + SCRAPE_S, 3))

        # The template variables as Grafana would fill them (label_values(metric, instance)).
        found: dict[str, list[str]] = {}
        for name, (metric, label, _) in dashboard.INSTANCE_VARIABLES.items():
            url = (f"{prom.url}/api/v1/label/{label}/values?"
                   + urllib.parse.urlencode({"match[]": metric}))
            found[name] = sorted(json.loads(procs.wait_http(url, 10))["data"])
        assert found == {"kvgate": [_hostport(kv)], "engine": sorted([_hostport(e1.url), _hostport(e2.url)])}

        committed = json.loads(DASHBOARD.read_text())
        qs = dashboard.queries(committed)
        assert len(qs) >= 40
        assert qs == dashboard.spec_queries()
        for variables in ({"kvgate": None, "engine": None}, found):
            problems = await asyncio.to_thread(dashboard.check, prom.url, qs, variables, RATE_INTERVAL)
            assert problems == [], "\n".join(f"{t} [{r}]: {p}: {q}" for t, r, q, p in problems)

        # Concrete values through the same queries.
        def panel(title: str, ref: str = "A") -> list[dict]:
            expr = next(e for t, r, e in qs if t == title and r == ref)
            return _query(prom.url, dashboard.substitute(expr, found, RATE_INTERVAL))

        assert _values(panel("Token budget"), "") == {"": 3600.0}
        states = _values(panel("Sessions by state"), "state")
        assert states["active"] >= 7 and states["closed"] >= 1
        assert states["active"] + states["closing"] + states["closed"] == 11  # s0-s8, p, late
        assert set(_values(panel("Sessions closed per second, by reason"), "reason")) >= {"admin_api"}
        assert set(_values(panel("Session id source (named vs inferred)"), "source")) == {"header"}
        assert set(_values(panel("Admission decisions per second", "C"), "reason")) == {"protected", "degraded",
                                                                                       "aged"}
        errors = _values(panel("Upstream errors and client disconnects"), "kind")
        assert set(errors) == {"unreachable", "timeout", "cut", "protocol_error"}  # known kinds exist at 0 from the start
        assert errors["unreachable"] > 0 and errors["timeout"] == errors["cut"] == errors["protocol_error"] == 0
        assert _values(panel("kvgate internal faults"), "stage") == {
            "session": 0.0, "registry": 0.0, "admission": 0.0, "idle_sweep": 0.0, "inference": 0.0,
            "placement": 0.0, "observer": 0.0}
        assert ("/generate", "error") in {(r["metric"]["route"], r["metric"]["status"])
                                          for r in panel("Requests per second by route and status")}
        assert set(_values(panel("Running requests per engine"), "instance")) == set(found["engine"])
        warnings = panel("Engine warnings")
        assert [(r["metric"]["engine"], r["metric"]["kind"], r["value"][1]) for r in warnings] == \
            [(e2.url, "session_radix_cache_off", "1")]
        assert _values(panel("Budget degraded"), "instance") == {_hostport(kv): 0.0}
    finally:
        for p in reversed(started):
            p.stop()
