"""kvgate in front of the real smg 1.13 PD router (--pd-disaggregation) and simulated prefill and decode workers:
discovery of the roles, session_id on both legs of every generate route, a session's turns on one decode worker,
and a close that reaches every worker."""

import asyncio
import logging

import aiohttp
import orjson
import pytest

from conftest import CloseWatcher

ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions")


async def _turn(http, kv, route, sid, state):
    """One turn of session ``sid`` on ``route``; ``state`` carries the growing prompt. Returns (cached tokens,
    the worker smg names)."""
    hdr = {"X-Session-ID": sid}
    if route == "/generate":
        body = {"input_ids": state.setdefault("ids", list(range(1, 401))),
                "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    elif route == "/v1/chat/completions":
        body = {"model": "kvgate-sim", "max_tokens": 5,
                "messages": state.setdefault("msgs", [{"role": "user", "content": "solve the task " * 20}])}
    else:
        body = {"model": "kvgate-sim", "prompt": state.setdefault("text", "p" * 400), "max_tokens": 4}
    async with http.post(kv + route, json=body, headers=hdr) as r:
        assert r.status == 200, await r.text()
        obj = orjson.loads(await r.read())
        worker = r.headers.get("x-smg-routed-worker-id")
    if route == "/generate":
        state["ids"] = state["ids"] + obj["output_ids"] + [300] * 20
        return obj["meta_info"]["cached_tokens"], worker
    if route == "/v1/chat/completions":
        state["msgs"] = state["msgs"] + [{"role": "assistant", "content": obj["choices"][0]["message"]["content"]},
                                         {"role": "user", "content": "observation " * 5}]
    else:
        state["text"] = state["text"] + obj["choices"][0]["text"] + " obs " * 5
    return obj["usage"]["prompt_tokens_details"]["cached_tokens"], worker


async def test_kvgate_finds_the_pd_layout_and_shows_each_role(pd_fleet, kvgate_factory, caplog):
    """/kvgate/engines lists each worker with its role (and a prefill worker's bootstrap port), the layout in one
    log line; /kvgate/health counts prefill and decode workers alike."""
    router, pres, decs = await pd_fleet(prefill=2, decode=3)
    with caplog.at_level(logging.INFO, logger="kvgate.fleet.directory"):
        gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True)
        await gw.directory.first_refresh.wait()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fleet layout:")]
    assert lines == ["fleet layout: 2 prefill + 3 decode workers (PD; sessions live on the decode workers)"]
    async with aiohttp.ClientSession() as http:
        async with http.get(kv + "/kvgate/engines") as r:
            out = await r.json()
        async with http.get(kv + "/kvgate/health") as r:
            health = await r.json()
    assert out["layout"] == {"kind": "pd", "regular": 0, "prefill": 2, "decode": 3, "dp_ranks": 5,
                             "description": lines[0][len("fleet layout: "):]}
    by_url = {e["url"]: e for e in out["engines"]}
    for p in pres:
        assert by_url[p.url]["worker_type"] == "prefill" and not by_url[p.url]["holds_sessions"]
        assert by_url[p.url]["bootstrap_port"] == p.engine.opts.disaggregation_bootstrap_port
    for d in decs:
        assert by_url[d.url]["worker_type"] == "decode" and by_url[d.url]["holds_sessions"]
        assert by_url[d.url]["bootstrap_port"] is None
    (engines,) = [c for c in health["checks"] if c["check"] == "engines"]
    assert engines["ok"] is True and engines["engines"] == 5
    assert engines["usable_by_role"] == {"prefill": 2, "decode": 3}
    assert gw.directory.kv_holder_urls == [d.url for d in decs] or \
        sorted(gw.directory.kv_holder_urls) == sorted(d.url for d in decs)
    assert sorted(gw.directory.prefill_urls) == sorted(p.url for p in pres)


async def test_a_session_reaches_both_legs_stays_on_one_decode_worker_and_its_close_reaches_every_worker(
        pd_fleet, kvgate_factory):
    """Three turns of a session on each generate route through kvgate and smg's PD router (--policy
    consistent_hashing on kvgate's routing key): session_id reaches the prefill and the decode leg of every turn
    (counted per worker), every turn is decoded on the same decode worker with more cached tokens each turn;
    the client's close reaches every prefill and decode worker once."""
    router, pres, decs = await pd_fleet(prefill=2, decode=3)
    workers = [*pres, *decs]
    watchers = {w.url: CloseWatcher(w) for w in workers}
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True)
    await gw.directory.first_refresh.wait()
    async with aiohttp.ClientSession() as http:
        for route in ROUTES:
            sid, state = "pd-" + route.strip("/").replace("/", "-"), {}
            cached, routed = [], set()
            for _ in range(3):
                c, worker = await _turn(http, kv, route, sid, state)
                cached.append(c)
                routed.add(worker)
            assert len(routed) == 1, (route, routed)
            (home,) = [d for d in decs if d.url in routed]
            assert cached[0] < cached[1] < cached[2], (route, cached)
            per_decode = [d.stats()["sessions"].get(sid, 0) for d in decs]
            assert sorted(per_decode) == [0, 0, 3] and home.stats()["sessions"][sid] == 3
            assert sum(p.stats()["sessions"].get(sid, 0) for p in pres) == 3  # every turn's prefill leg
            async with http.post(kv + "/close_session", json={"session_id": sid}) as r:
                assert r.status == 200
            await asyncio.gather(*(w.wait_for(sid) for w in watchers.values()))
            assert all(w.ids.count(sid) == 1 for w in watchers.values())
            assert all(w.stats()["session_state"].get(sid, {"ref_tokens": 0})["ref_tokens"] == 0 for w in workers)


async def test_a_close_a_decode_worker_fails_is_retried_until_it_has_it(pd_fleet, kvgate_factory):
    """A decode worker answers the first close with a 5xx: kvgate retries it (as for any engine) while the others
    are done at once; in the end every worker closed the session."""
    router, pres, decs = await pd_fleet(prefill=1, decode=2)
    flaky = decs[1]
    watchers = {w.url: CloseWatcher(w) for w in (*pres, *decs)}
    inner, failed = flaky.engine.close_session, []

    def close_once_failing(session_id):
        if not failed:
            failed.append(session_id)
            raise RuntimeError("decode worker busy")
        return inner(session_id)
    flaky.engine.close_session = close_once_failing
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, close_retry_backoff_s=0.05)
    await gw.directory.first_refresh.wait()
    async with aiohttp.ClientSession() as http:
        await _turn(http, kv, "/generate", "pd-retry", {})
        async with http.post(kv + "/close_session", json={"session_id": "pd-retry"}) as r:
            assert r.status == 200
        await asyncio.gather(*(w.wait_for("pd-retry") for w in watchers.values()))
    assert failed == ["pd-retry"]
    assert all(w.ids == ["pd-retry"] for w in watchers.values())
    reg = gw.lifecycle.registry
    await gw.lifecycle.wait_until(lambda: reg.get("pd-retry").state == "closed")
    assert reg.close_stats["failed_attempts"] == 1


async def test_smg_pd_names_the_decode_worker_by_target_worker_index(pd_fleet):
    """smg 1.13 PD with --policy cache_aware --decode-policy consistent_hashing: X-SMG-Target-Worker: i decodes on
    one decode worker per index, whatever the prefill policy picks; on /generate the i-th healthy decode worker
    of /workers (kvgate's first guess), on the OpenAI routes another fixed order (learned from the answers by
    kvgate.fleet.decode_naming); an index past the decode workers is a 503 no_available_workers."""
    from kvgate.fleet.decode_naming import DecodeNaming
    from kvgate.fleet.discovery import parse_workers
    router, pres, decs = await pd_fleet(prefill=2, decode=4, policy="cache_aware",
                                        extra=["--decode-policy", "consistent_hashing"])
    naming = DecodeNaming()
    async with aiohttp.ClientSession() as http:
        async with http.get(router + "/workers") as r:
            naming.set_workers(parse_workers(await r.json()))
        orders = {}
        for route, body in (("/generate", {"input_ids": list(range(1, 50)), "sampling_params": {"max_new_tokens": 2}}),
                            ("/v1/chat/completions", {"model": "kvgate-sim", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "hi"}]}),
                            ("/v1/completions", {"model": "kvgate-sim", "max_tokens": 2, "prompt": "hi"})):
            orders[route] = []
            for i in (0, 1, 2, 3, 0, 1, 2, 3):
                async with http.post(router + route, json=body, headers={"X-SMG-Target-Worker": str(i)}) as r:
                    assert r.status == 200
                    orders[route].append(r.headers["x-smg-routed-worker-id"])
            assert orders[route][:4] == orders[route][4:] and sorted(orders[route][:4]) == sorted(d.url for d in decs)
        assert orders["/generate"][:4] == [naming.index(d, "/generate", 0.0) is not None and d
                                           for d in sorted(orders["/generate"][:4],
                                                           key=lambda u: naming.index(u, "/generate", 0.0))]
        async with http.post(router + "/generate", json={"input_ids": [1, 2]},
                             headers={"X-SMG-Target-Worker": str(len(decs))}) as r:
            assert r.status == 503 and r.headers["X-SMG-Error-Code"] == "no_available_workers"
    assert sum(p.stats()["totals"]["num_requests"] for p in pres) == 3 * 8


async def test_smg_pd_keeps_each_index_on_one_decode_worker_under_load_without_overload_protection(pd_fleet):
    """240 concurrent named calls with long prompts on 2 prefill + 6 slow decode workers (smg --decode-policy
    consistent_hashing --disable-worker-overload-protection): every index is decoded on one worker. (With the
    protection on, smg's default, workers leave its count under load and one index landed on all six: measured,
    docs/compatibility.md; kvgate then stops naming.)"""
    import random
    router, pres, decs = await pd_fleet(prefill=2, decode=6, policy="cache_aware", speed=2,
                                        max_total_num_tokens=20000,
                                        extra=["--decode-policy", "consistent_hashing", "--load-monitor-interval",
                                               "1", "--disable-worker-overload-protection"])
    rng = random.Random(7)
    seen: dict[int, set] = {i: set() for i in range(6)}
    async with aiohttp.ClientSession() as http:
        async def one(k):
            i = k % 6
            body = {"input_ids": [rng.randrange(1000) for _ in range(rng.randrange(200, 3000))],
                    "sampling_params": {"max_new_tokens": 50}}
            async with http.post(router + "/generate", json=body, headers={"X-SMG-Target-Worker": str(i)}) as r:
                await r.read()
                assert r.status == 200
                seen[i].add(r.headers["x-smg-routed-worker-id"])
        await asyncio.gather(*(one(k) for k in range(240)))
    assert all(len(w) == 1 for w in seen.values()), seen
    assert sorted(w for ws in seen.values() for w in ws) == sorted(d.url for d in decs)


async def _smg_branches(http, url) -> dict[str, float]:
    """smg's consistent_hashing policy's decisions by branch, from its Prometheus /metrics."""
    async with http.get(url) as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("smg_consistent_hashing_policy_branch_total{"):
            branch = line.split('branch="', 1)[1].split('"', 1)[0]
            out[branch] = out.get(branch, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def test_kvgate_places_each_session_on_a_decode_worker_and_smg_decodes_it_there(pd_fleet, kvgate_factory):
    """2 prefill + 3 decode workers behind smg (--policy cache_aware --decode-policy consistent_hashing), session
    lifecycle on: kvgate places six sessions with prompts of their own on the decode workers (two each: the
    least loaded first, no prefix to follow) and names the worker
    in each call; every turn of a session is decoded on the worker kvgate chose, with more cached tokens each
    turn, on every generate route. smg counts every named call as a target_worker_hit; kvgate learns the OpenAI
    routes' order in at most two answers a route (three workers)."""
    router, pres, decs = await pd_fleet(prefill=2, decode=3, policy="cache_aware",
                                        extra=["--decode-policy", "consistent_hashing"])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True)
    await gw.directory.first_refresh.wait()
    calls = 0
    async with aiohttp.ClientSession() as http:
        for k in range(6):
            route, sid = ROUTES[k % 3], f"pd-placed-{k}"
            state = {"ids": list(range(1000 * k + 1, 1000 * k + 401)), "text": f"task {k} " * 60,
                     "msgs": [{"role": "user", "content": f"solve task {k} " * 20}]}
            cached, routed = [], []
            for _ in range(3):
                c, worker = await _turn(http, kv, route, sid, state)
                calls += 1
                cached.append(c)
                routed.append(worker)
                assert worker == gw.placement.engine_of(sid)[0], (route, k)
            assert len(set(routed)) == 1 and cached[0] < cached[1] < cached[2], (route, routed, cached)
        branches = await _smg_branches(http, pd_fleet.metrics[router])
        async with http.get(kv + "/kvgate/health") as r:
            health = await r.json()
        async with http.get(kv + "/kvgate/engines") as r:
            engines = await r.json()
    assert set(health["session_placement"].values()) == {"kvgate"}
    assert all("kvgate names the decode worker" in w for w in health["session_placement_why"].values())
    assert engines["placement"]["decode_naming"]["state"] == "naming"
    naming = gw.placed.naming
    assert naming.state == "naming" and naming.refusals == 0 and naming.contradicted == 0
    assert naming.hits + naming.relearned == calls == 18 and naming.relearned <= 2 * 2  # two OpenAI routes
    assert branches.get("target_worker_hit") == calls and branches.get("target_worker_miss", 0) == 0
    assert sorted(gw.placement.sessions_on(d.url) for d in decs) == [2, 2, 2]
    per_decode = sorted(sum(1 for s in d.stats()["sessions"] if s.startswith("pd-placed-")) for d in decs)
    assert per_decode == [2, 2, 2]


@pytest.mark.parametrize("growth", [True, False])
async def test_a_new_program_on_a_full_decode_worker_goes_to_one_with_room_at_once(pd_fleet, kvgate_factory, growth):
    """One prefill and two decode workers of 4,000 tokens (ceilings 3,600), program admission: a session holds
    3,200 tokens on its decode worker between turns; a new program sharing its prompt's start goes at once to
    the other decode worker, where smg decodes it because kvgate names it. Nothing waits or pauses. Placement
    counting session growth sees the home worker's projected KV (3,200 held + the new session's 3,300) past
    0.95 x 4,000 and places it there itself (kv_moved); by the engines' figures alone placement puts it on
    its prefix's worker and admission, finding no room, moves it (moved, counted per session)."""
    router, pres, decs = await pd_fleet(prefill=1, decode=2, policy="cache_aware",
                                        extra=["--decode-policy", "consistent_hashing"],
                                        max_total_num_tokens=4000, speed=20)
    gw, kv = await kvgate_factory(upstream=router, agentic_program_admission=True, admission_policy="program",
                                  admission_pause_start_ratio=0, agentic_session_lifecycle=True,
                                  session_placement="kvgate", admission_poll_interval_s=0.1,
                                  discovery_interval_s=0.2, agentic_admission_max_wait_s=60.0,
                                  placement_pressure_threshold=0.95, placement_session_growth=growth)
    await gw.directory.first_refresh.wait()
    while gw.gate.ledger.snapshot is None or len(gw.gate.ledger.snapshot.engines) < 2:
        await gw.poller.round_done.wait()

    async def post(http, ids, sid):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
        async with http.post(kv + "/generate", json=body, headers={"X-Session-ID": sid}) as r:
            assert r.status == 200, await r.text()
            return orjson.loads(await r.read()), r.headers

    first = list(range(1000, 2500))
    async with aiohttp.ClientSession() as http:
        t1, _ = await post(http, first, "home")
        t2, h2 = await post(http, first + t1["output_ids"] + list(range(3000, 4500)), "home")
        home = gw.placement.engine_of("home")[0]
        assert h2["x-smg-routed-worker-id"] == home and gw.gate.ledger.reserved_on(home) == 3200
        obj, h = await post(http, first + list(range(5000, 6800)), "new")
        async with http.get(kv + "/kvgate/sessions/new") as r:
            new = await r.json()
    other = next(d.url for d in decs if d.url != home)
    assert obj["meta_info"]["completion_tokens"] == 100
    assert (h["X-Kvgate-Admission"], h["X-Kvgate-Queue-Ms"]) == ("admit", "0")
    assert h["x-smg-routed-worker-id"] == other
    moved = 0 if growth else 1
    assert new["engine"]["url"] == other and new["engine"]["moves"] == moved, new
    counters = gw.gate.stats()["counters"]
    assert counters["moved"] == moved and counters["pause"] == 0, counters
    assert gw.placement.counts["kv_moved"] == (1 if growth else 0), gw.placement.counts
    assert next(d for d in decs if d.url == other).stats()["sessions"].get("new") == 1


async def test_kvgate_stops_naming_where_smg_decode_policy_ignores_the_name(pd_fleet, kvgate_factory, caplog):
    """smg with --policy round_robin on both sides ignores X-SMG-Target-Worker: answers for one index come
    from different decode workers, kvgate switches naming off after three such contradictions (one warning)
    and leaves the decode worker to smg; every call is answered."""
    router, pres, decs = await pd_fleet(prefill=1, decode=3, policy="round_robin")
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True)
    await gw.directory.first_refresh.wait()
    naming = gw.placed.naming
    async with aiohttp.ClientSession() as http:
        with caplog.at_level(logging.WARNING, logger="kvgate"):
            for k in range(12):
                c, worker = await _turn(http, kv, "/generate", f"rr-{k % 4}", {})
                assert worker in {d.url for d in decs}
        async with http.get(kv + "/kvgate/health") as r:
            health = await r.json()
    assert health["session_placement"]["/generate"] == "router"
    assert "did not honour" in health["session_placement_why"]["/generate"]
    assert naming.state == "off" and naming.contradicted == 3, naming.as_json(0)
    warned = [r for r in caplog.records if "does not read X-SMG-Target-Worker" in r.getMessage()]
    assert len(warned) == 1
    assert sum(d.stats()["totals"]["num_requests"] for d in decs) == 12


async def test_a_refused_name_goes_again_unnamed_and_the_client_never_sees_it(pd_fleet, kvgate_factory, caplog):
    """smg with consistent_hashing on both sides (one prefill, three decode workers): an index past the prefill
    workers is refused (503 no_available_workers) before any worker sees the call. kvgate sends that call again
    unnamed, leaves the decode worker to smg from then on (one warning), and the client gets every answer:
    the prefill workers and the decode workers served each call once."""
    router, pres, decs = await pd_fleet(prefill=1, decode=3)
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True)
    await gw.directory.first_refresh.wait()
    with caplog.at_level(logging.WARNING, logger="kvgate"):
        async with aiohttp.ClientSession() as http:
            for k in range(6):
                state = {"ids": list(range(1000 * k + 1, 1000 * k + 401))}  # prompts of their own: placed apart
                for _ in range(2):
                    c, worker = await _turn(http, kv, "/generate", f"ch-{k}", state)
                    assert worker in {d.url for d in decs}
                    assert gw.placement.engine_of(f"ch-{k}")[0] == worker
    naming = gw.placed.naming
    sample = gw.metrics.registry.get_sample_value
    calls = {o: sample("agentic_kv_placement_calls_total", {"outcome": o}) or 0
             for o in ("decode_named", "decode_name_refused", "decode_unnamed")}
    assert naming.state == "off" and naming.refusals == 1 and calls["decode_name_refused"] == 1, naming.as_json(0)
    assert calls["decode_named"] == naming.hits >= 1  # the calls before the refusal, on index 0
    assert calls["decode_named"] + calls["decode_name_refused"] + calls["decode_unnamed"] == 12
    assert len([r for r in caplog.records if "503 no_available_workers" in r.getMessage()]) == 1
    assert sum(p.stats()["totals"]["num_requests"] for p in pres) == 12
    assert sum(d.stats()["totals"]["num_requests"] for d in decs) == 12


async def test_admission_counts_the_decode_pools_and_lets_a_held_call_go_when_a_session_closes(pd_fleet,
                                                                                               kvgate_factory):
    """PD fleet of one prefill and two decode workers of 4,000 tokens each: the ledger's ceiling is the decode
    workers' pools x headroom (7,200; the prefill pool holds no session between turns). Two agents hold 3,200
    tokens each between turns; a new program's 1,700-token turn waits in kvgate until one agent's session
    closes, then goes."""
    router, pres, decs = await pd_fleet(prefill=1, decode=2, max_total_num_tokens=4000)
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, agentic_program_admission=True,
                                  admission_policy="program", admission_pause_start_ratio=0,
                                  admission_poll_interval_s=0.1,
                                  discovery_interval_s=0.2, agentic_admission_max_wait_s=60.0)
    await gw.directory.first_refresh.wait()
    while gw.gate.ledger.snapshot is None:
        await gw.poller.round_done.wait()
    assert sorted(gw.gate.ledger.snapshot.engines) == sorted(d.url for d in decs)
    assert gw.gate.ledger.ceiling == 7200

    async def turn(http, sid, ids):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        async with http.post(kv + "/generate", json=body, headers={"X-Session-ID": sid}) as r:
            assert r.status == 200, await r.text()
            return orjson.loads(await r.read()), r.headers

    async with aiohttp.ClientSession() as http:
        for k, sid in enumerate(("a", "b")):
            first = list(range(10_000 * (k + 1), 10_000 * (k + 1) + 1500))
            obj, _ = await turn(http, sid, first)
            await turn(http, sid, first + obj["output_ids"] + list(range(50_000 + 2000 * k, 51_300 + 2000 * k)))
        assert gw.gate.ledger.reserved == 6400
        held = asyncio.create_task(turn(http, "c", list(range(90_000, 91_500))))
        await gw.gate.wait_until(lambda: gw.gate.coord.waiting == 1)
        assert not held.done()
        async with http.post(kv + "/close_session", json={"session_id": "a"}) as r:
            assert r.status == 200
        obj, h = await held
    assert obj["meta_info"]["completion_tokens"] == 200
    assert h["X-Kvgate-Admission"] == "admit" and int(h["X-Kvgate-Queue-Ms"]) > 0
    assert gw.gate.ledger.reserved == 3200 + 1700  # b and c between turns; a closed
