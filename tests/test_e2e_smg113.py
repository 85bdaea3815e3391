"""kvgate in front of the real smg 1.13 (python -m smg) and simulated engines: default placement, the engine the
router names in x-smg-routed-worker-id, the routing key its policies read, and its API key."""

import asyncio
import logging

import aiohttp
import orjson
import pytest

from kvgate.tools import procs

pytestmark = pytest.mark.skipif(not procs.smg_installed(), reason="smg router not installed")

SIM = dict(max_total_num_tokens=50_000, speed=50)


def _where(sid, *engines):
    """Per engine: how many requests carrying ``sid`` it saw."""
    return [e.stats()["sessions"].get(sid, 0) for e in engines]


async def _turns(http, kv, route, sid, n, headers=None):
    """``n`` turns of one session on ``route`` (/generate plain or streamed, chat streamed, completions), the
    prompt growing like an agent's; returns each turn's cached tokens (what the engine's radix cache held)."""
    cached = []
    prompt, msgs = list(range(1, 161)), [{"role": "user", "content": "solve the task " * 20}]
    text = "p" * 400
    for turn in range(n):
        hdr = {"X-Session-ID": sid, **(headers or {})}
        if route in ("/generate", "/generate-sse"):
            stream = route == "/generate-sse"
            body = {"input_ids": prompt, "stream": stream, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
            async with http.post(kv + "/generate", json=body, headers=hdr) as r:
                assert r.status == 200, await r.text()
                raw = await r.read()
            last = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")][-1] if stream \
                else orjson.loads(raw)
            cached.append(last["meta_info"]["cached_tokens"])
            prompt = prompt + last["output_ids"] + [300 + turn] * 5
        elif route == "/v1/chat/completions":
            body = {"model": "kvgate-sim", "messages": msgs, "max_tokens": 5, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with http.post(kv + route, json=body, headers=hdr) as r:
                assert r.status == 200, await r.text()
                raw = await r.read()
            events = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
            out = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
            usage = [e["usage"] for e in events if e.get("usage")][-1]
            cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            msgs = msgs + [{"role": "assistant", "content": out}, {"role": "user", "content": f"observation {turn}"}]
        else:
            async with http.post(kv + route, json={"model": "kvgate-sim", "prompt": text, "max_tokens": 4},
                                 headers=hdr) as r:
                assert r.status == 200, await r.text()
                obj = await r.json()
            cached.append((obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            text = text + obj["choices"][0]["text"] + f" obs {turn} " * 3
    return cached


def _record_engine_lookups(gw):
    """Where the request path told admission each session's call goes (RequestInfo.place, decided by the
    placement stage), per session, in call order."""
    seen: dict[str, list] = {}
    inner = gw.gate.acquire

    async def acquire(info):
        if info.session_id is not None:
            seen.setdefault(info.session_id, []).append(info.place)
        return await inner(info)
    gw.gate.acquire = acquire
    return seen


async def test_defaults_behind_smg_round_robin_keep_each_session_on_one_engine_on_every_route(
        sim_factory, router_factory, kvgate_factory, caplog):
    """Lifecycle and admission on, every placement key at its default, behind smg 1.13 round_robin (which would
    alternate a session's turns between the engines): kvgate places every route's sessions, each session's turns
    land on one engine and hit its cache, and admission counts each later turn on that engine."""
    e1, e2 = await sim_factory(**SIM), await sim_factory(**SIM)
    router = await router_factory([e1.url, e2.url], policy="round_robin")
    caplog.set_level(logging.INFO, logger="kvgate")
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, agentic_program_admission=True,
                                  admission_poll_interval_s=0.2, session_inference=False,
                                  admission_chars_per_token=1.0)
    await gw.directory.first_refresh.wait()
    lookups = _record_engine_lookups(gw)
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("session placement:")]
    assert line == ["session placement: /generate kvgate (auto: session lifecycle and admission on), "
                    "/v1/chat/completions kvgate (auto: session lifecycle and admission on), "
                    "/v1/completions kvgate (auto: session lifecycle and admission on)"]
    async with aiohttp.ClientSession() as http:
        async with http.get(kv + "/kvgate/health") as r:
            health = await r.json()
        assert health["session_placement"] == dict.fromkeys(("/generate", "/v1/chat/completions",
                                                             "/v1/completions"), "kvgate")
        # the four shapes a rollout sends, two sessions each, three turns per session
        for route in ("/generate", "/generate-sse", "/v1/chat/completions", "/v1/completions"):
            for k in range(2):
                sid = f"{route}-{k}"
                cached = await _turns(http, kv, route, sid, 3)
                assert sorted(_where(sid, e1, e2)) == [0, 3], (route, _where(sid, e1, e2))
                assert all(c > 0 for c in cached[1:]), (route, cached)  # later turns re-use the session's KV
                home = (e1, e2)[_where(sid, e1, e2).index(3)]
                assert gw.placement.engine_of(sid) == (home.url, None)
                # placement decides before admission: admission counts every turn, the first too, on that engine
                assert lookups[sid] == [(home.url, None)] * 3, (sid, lookups[sid])
        async with http.get(kv + "/kvgate/sessions") as r:
            sessions = {s["session_id"]: s for s in (await r.json())["sessions"]}
    assert sessions["/generate-0"]["engine"]["placed_by"] == "kvgate"
    assert gw.metrics.render()[0].decode().count('agentic_kv_placement_calls_total{outcome="engine"} 24.0') == 1


async def test_router_placement_learns_each_sessions_engine_from_smg_sticky_sessions(
        sim_factory, router_factory, kvgate_factory):
    """session_placement: router behind smg 1.13 --sticky-sessions (round_robin policy): smg keeps each
    session on one worker by the routing key kvgate sends and names it in x-smg-routed-worker-id; kvgate
    shows that engine in /kvgate/sessions and admission counts the session's later turns on it."""
    e1, e2 = await sim_factory(**SIM), await sim_factory(**SIM)
    router = await router_factory([e1.url, e2.url], policy="round_robin", extra=["--sticky-sessions"])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, agentic_program_admission=True,
                                  session_placement="router", admission_poll_interval_s=0.2,
                                  session_inference=False, router_policy="round_robin", router_sticky_sessions=True)
    await gw.directory.first_refresh.wait()
    lookups = _record_engine_lookups(gw)
    homes = {}
    async with aiohttp.ClientSession() as http:
        for k in range(4):
            sid = f"sticky-{k}"
            cached = await _turns(http, kv, "/generate-sse" if k % 2 else "/generate", sid, 3)
            where = _where(sid, e1, e2)
            assert sorted(where) == [0, 3], where  # smg kept the session on one worker
            assert all(c > 0 for c in cached[1:])
            homes[sid] = (e1, e2)[where.index(3)].url
            assert lookups[sid] == [None, (homes[sid], None), (homes[sid], None)], lookups[sid]
            async with http.get(kv + f"/kvgate/sessions/{sid}") as r:
                s = await r.json()
            assert s["engine"] == {"url": homes[sid], "dp_rank": None, "placed_by": "router", "moves": 0}
    assert len(set(homes.values())) == 2  # round_robin put the sessions on both engines: the header told which
    assert gw.placement.counts["routed"] == 4 and gw.placement.counts["free_kv"] == 0


async def test_router_placement_behind_plain_round_robin_follows_the_router(sim_factory, router_factory,
                                                                             kvgate_factory):
    """Without sticky sessions smg 1.13 round_robin moves a session between the engines: kvgate's record of the
    session's engine follows the router's answer turn by turn (never a stale engine for admission)."""
    e1, e2 = await sim_factory(**SIM), await sim_factory(**SIM)
    router = await router_factory([e1.url, e2.url], policy="round_robin")
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, session_placement="router",
                                  session_inference=False)
    await gw.directory.first_refresh.wait()
    async with aiohttp.ClientSession() as http:
        seen = []
        for _ in range(4):
            await _turns(http, kv, "/v1/completions", "rr", 1)
            seen.append(gw.placement.engine_of("rr")[0])
    assert sorted(_where("rr", e1, e2)) == [2, 2]
    assert set(seen) == {e1.url, e2.url} and all(a != b for a, b in zip(seen, seen[1:]))


@pytest.mark.parametrize("policy,extra,kept", [("consistent_hashing", [], True), ("manual", [], True),
                                               ("round_robin", ["--sticky-sessions"], True),
                                               ("cache_aware", ["--sticky-sessions"], True),
                                               ("round_robin", [], False)])
async def test_smg113_routing_key_policies(sim_factory, router_factory, policy, extra, kept):
    """The facts the routing-key warning rests on, measured on smg 1.13: consistent_hashing, manual and any
    policy with --sticky-sessions keep every X-SMG-Routing-Key on one worker; round_robin alone does not. Every
    proxied answer names the worker in x-smg-routed-worker-id."""
    e1, e2 = await sim_factory(**SIM), await sim_factory(**SIM)
    router = await router_factory([e1.url, e2.url], policy=policy, extra=extra)
    async with aiohttp.ClientSession() as http:
        for k in range(6):
            for _ in range(3):
                async with http.post(router + "/generate", headers={"X-SMG-Routing-Key": f"key-{k}"},
                                     json={"input_ids": [k + 1] * 40, "session_id": f"key-{k}",
                                           "sampling_params": {"max_new_tokens": 1}}) as r:
                    assert r.status == 200
                    await r.read()
                    worker = r.headers["x-smg-routed-worker-id"]
                assert worker in (e1.url, e2.url) and _where(f"key-{k}", *(e1, e2))[(e1.url, e2.url).index(worker)] > 0
    one_worker = [sorted(_where(f"key-{k}", e1, e2)) == [0, 3] for k in range(6)]
    assert all(one_worker) if kept else not any(one_worker), one_worker


async def _key_file(tmp_path, key):
    p = tmp_path / "router.key"
    p.write_text(key + "\n")
    return str(p)


async def test_behind_smg_api_key_kvgate_with_the_key_discovers_probes_closes_and_admits(
        sim_factory, router_factory, kvgate_factory, tmp_path, caplog):
    e1, e2 = await sim_factory(**SIM), await sim_factory(**SIM)
    key = "s3cret-router-key"
    router = await router_factory([e1.url, e2.url], extra=["--api-key", key])
    caplog.set_level(logging.DEBUG, logger="kvgate")
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, agentic_program_admission=True,
                                  compat_probe=True, admission_poll_interval_s=0.2, session_inference=False,
                                  router_api_key_file=await _key_file(tmp_path, key))
    await asyncio.wait_for(gw.directory.compat_checked.wait(), 30)
    assert sorted(gw.directory.urls) == sorted([e1.url, e2.url])
    assert gw.directory.verdicts == dict.fromkeys(("/generate", "/v1/chat/completions", "/v1/completions"),
                                                  "forwarded")
    assert gw.directory.router_auth == "ok"
    auth = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        while gw.gate.stats()["ledger"]["degraded"]:
            await asyncio.sleep(0.05)
        await _turns(http, kv, "/generate", "keyed", 2, auth)
        assert sorted(_where("keyed", e1, e2)) == [0, 2]
        assert gw.gate.stats()["ledger"]["degraded"] is False
        # a client without the router's key is not served around the router: the router answers it
        async with http.post(kv + "/generate", json={"input_ids": [1, 2, 3]}, headers={"X-Session-ID": "nokey"}) as r:
            assert r.status == 401
        assert _where("nokey", e1, e2) == [0, 0]
        async with http.post(kv + "/kvgate/sessions/keyed/close?wait=1") as r:
            closed = await r.json()
        async with http.get(kv + "/kvgate/health") as r:
            health = await r.json()
    assert closed["state"] == "closed" and sorted(closed["close_results"].values()) == ["ok", "ok"]
    assert health["router_auth"] == "ok"
    assert key not in caplog.text


@pytest.mark.parametrize("given", ["wrong", "none"])
async def test_behind_smg_api_key_a_wrong_or_missing_key_is_named_once_never_dropped(
        sim_factory, router_factory, kvgate_factory, caplog, monkeypatch, given):
    e1 = await sim_factory(**SIM)
    router = await router_factory([e1.url], extra=["--api-key", "the-right-key"])
    caplog.set_level(logging.INFO, logger="kvgate")
    keys = {}
    if given == "wrong":
        monkeypatch.setenv("KVGATE_TEST_ROUTER_KEY", "a-wrong-key")
        keys = {"router_api_key_env": "KVGATE_TEST_ROUTER_KEY"}
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, compat_probe=True,
                                  discovery_interval_s=0.2, **keys)
    await asyncio.wait_for(gw.directory.compat_checked.wait(), 30)
    for _ in range(3):  # a few more discovery rounds and probes: still one line
        await asyncio.wait_for(gw.directory.probed.wait(), 10)
    assert gw.directory.engines == [] and gw.directory.router_auth == "401"
    assert set(gw.directory.verdicts.values()) == {"unknown"}  # a 401 is not an answer about session_id
    lines = [r for r in caplog.records if "401" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "ERROR", [r.getMessage() for r in lines]
    msg = lines[0].getMessage()
    assert "401 Unauthorized" in msg and ("refused kvgate's API key" if given == "wrong" else "needs an API key") in msg
    assert "a-wrong-key" not in caplog.text
    async with aiohttp.ClientSession() as http:
        async with http.get(kv + "/kvgate/health") as r:
            health = await r.json()
    assert health["router_auth"] == "401" and health["engines"] == 0
