"""Session lifecycle through real sockets: failed closes retried until every engine has them, aborts that are
step boundaries, sessions that come back, retried turns, stream usage, and close fan-out under load.

client -> kvgate -> real smg router -> simulated SGLang engines (kvgate.sim, 0.5.17 session semantics);
kvgate calls the engines' /close_session directly, here through a NetGate that can cut an engine's HTTP side.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time

import aiohttp
import orjson

import kvgate
from conftest import CloseWatcher
from netgate import NetGate

SIM = {"max_total_num_tokens": 60_000, "speed": 50}


def refs(h, sid: str) -> int:
    """Tokens an in-process simulated engine holds referenced by session ``sid`` (0.5.17 references)."""
    return sum(r.cache.session_ref_tokens(sid) for r in h.engine.ranks)


async def _post(http, url, body, headers=None):
    async with http.post(url, data=orjson.dumps(body),
                         headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, await r.read(), r.headers


def _metric(gw, line: str) -> float:
    for ln in gw.metrics.render()[0].decode().splitlines():
        if ln.startswith(line + " "):
            return float(ln.rsplit(" ", 1)[1])
    raise AssertionError(f"no series {line}")


async def test_close_missed_by_an_unreachable_engine_is_retried_until_it_has_it(sim_factory, router_factory,
                                                                                kvgate_factory):
    a, b = await sim_factory(**SIM), await sim_factory(**SIM)
    ga, gb = await NetGate.open(a.port), await NetGate.open(b.port)
    router = await router_factory([a.url, b.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, close_timeout_s=0.5,
                                  close_retry_backoff_s=30.0,  # only the client's asks retry in this test
                                  engines=[ga.url, gb.url])
    try:
        async with aiohttp.ClientSession() as http:
            # /v1/completions: smg forwards the top-level session_id there (it drops it on /generate)
            st, _, _ = await _post(http, kv + "/v1/completions", {"model": "kvgate-sim", "prompt": "x" * 300,
                                                                   "max_tokens": 8}, {"X-Session-ID": "s-b"})
            assert st == 200
            ran = [(h, g) for h, g in ((a, ga), (b, gb)) if h.stats()["sessions"].get("s-b")]
            assert len(ran) == 1
            eng, gate = ran[0]  # "B": the engine the turn ran on
            other = a if eng is b else b
            held = refs(eng, "s-b")
            assert held >= 300
            await gate.down()
            async with http.post(kv + "/close_session", json={"session_id": "s-b"}) as r:
                assert r.status == 200 and await r.json() == {"session_id": "s-b", "known": True,
                                                              "state": "closing", "engines": 2}
            reg = gw.lifecycle.registry
            await gw.lifecycle.wait_until(lambda: len(reg.get("s-b").close_results) == 2)
            s = reg.get("s-b")
            assert s.state == "closing"  # not closed: B does not have it
            assert s.close_results[gate.url].startswith("connect error")
            assert eng.stats()["closes_received"] == 0 and refs(eng, "s-b") == held
            # The client asks again while B is still down: sent again at once, fails again, stays pending.
            async with http.post(kv + "/close_session", json={"session_id": "s-b"}) as r:
                assert r.status == 200
            await gw.lifecycle.wait_until(lambda: reg.close_stats["failed_attempts"] == 2)
            assert s.state == "closing" and s.engine_closes[gate.url].state == "pending"
            assert _metric(gw, 'agentic_kv_session_close_pending{state="pending"}') == 1.0
            await gate.up()  # B's HTTP side is back, with the session's KV still referenced
            async with http.post(kv + "/kvgate/sessions/s-b/close", params={"wait": "1"}) as r:
                view = await r.json()
        assert view["state"] == "closed" and view["closes"] == 1 and view["close_reason"] == "client"
        assert view["close_results"] == {ga.url: "ok", gb.url: "ok"} and view["close_pending"] == {}
        assert eng.stats()["closes_received"] == 1 and other.stats()["closes_received"] == 1
        assert refs(eng, "s-b") == 0  # B ends with 0 tokens referenced by the session
        assert _metric(gw, 'agentic_kv_session_close_pending{state="pending"}') == 0.0
        assert _metric(gw, "agentic_kv_session_close_failure_total") == 2.0
        assert _metric(gw, 'agentic_kv_session_close_total{reason="client"}') == 1.0
    finally:
        await ga.close()
        await gb.close()


async def test_close_that_timed_out_is_not_success_and_is_retried_with_backoff(sim_factory, router_factory,
                                                                               kvgate_factory):
    e = await sim_factory(**SIM)
    gate = await NetGate.open(e.port)
    router = await router_factory([e.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, close_timeout_s=0.3,
                                  close_retry_backoff_s=0.05, engines=[gate.url])
    try:
        async with aiohttp.ClientSession() as http:
            st, _, _ = await _post(http, kv + "/v1/completions", {"model": "kvgate-sim", "prompt": "y" * 200,
                                                                   "max_tokens": 4}, {"X-Session-ID": "s-t"})
            assert st == 200 and refs(e, "s-t") >= 200
            gate.freeze()  # the engine accepts the connection and never answers
            async with http.post(kv + "/close_session", json={"session_id": "s-t"}) as r:
                assert r.status == 200
            reg = gw.lifecycle.registry
            await gw.lifecycle.wait_until(lambda: reg.close_stats["failed_attempts"] >= 1)
            s = reg.get("s-t")
            assert s.state == "closing" and s.close_results[gate.url] == "timeout after 0.3s"
            assert e.stats()["closes_received"] == 0
            gate.thaw()
            await gw.lifecycle.wait_until(lambda: s.state == "closed")  # retried by itself, no ask needed
        assert s.close_results == {gate.url: "ok"} and e.stats()["closes_received"] == 1
        assert refs(e, "s-t") == 0
        assert reg.close_stats["retries"] == reg.close_stats["failed_attempts"] >= 1
    finally:
        await gate.close()


async def test_weight_update_abort_is_a_step_boundary_and_the_session_continues(sim_factory, router_factory,
                                                                                kvgate_factory):
    e = await sim_factory(max_total_num_tokens=60_000, speed=1)
    router = await router_factory([e.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True)
    prompt = "You are a careful agent. " * 20
    async with aiohttp.ClientSession() as http:
        resp = await http.post(kv + "/v1/completions", json={
            "model": "kvgate-sim", "prompt": prompt, "max_tokens": 5000, "stream": True, "ignore_eos": True},
            headers={"X-Session-ID": "roll-1"})
        first = await resp.content.readuntil(b"\n\n")  # decoding has started
        assert first.startswith(b"data: {")
        # The trainer updates weights straight on the engine: the partial rollout's turn is aborted.
        st, _, _ = await _post(http, e.url + "/update_weights_from_disk", {"model_path": "/ckpt/2",
                                                                          "weight_version": "2"})
        assert st == 200
        rest = first + await resp.read()
        resp.release()
        chunks = [orjson.loads(x[6:]) for x in rest.split(b"\n\n") if x.startswith(b"data: {")]
        partial = "".join(c["choices"][0]["text"] for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort" and 0 < len(partial)
        reg = gw.lifecycle.registry
        await gw.lifecycle.wait_until(lambda: reg.get("roll-1").in_flight == 0)
        s = reg.get("roll-1")
        assert s.state == "active" and s.closes == 0 and e.stats()["closes_received"] == 0
        assert _metric(gw, 'agentic_kv_session_aborts_total{cause="other"}') == 1.0
        # The rollout continues the same session with prompt + partial output.
        st, body, _ = await _post(http, kv + "/v1/completions", {
            "model": "kvgate-sim", "prompt": prompt + partial, "max_tokens": 4}, {"X-Session-ID": "roll-1"})
        assert st == 200 and orjson.loads(body)["usage"]["completion_tokens"] == 4
        assert s.state == "active" and s.turns == 2 and s.reopened == 0 and s.closes == 0
        assert e.stats()["closes_received"] == 0
        assert refs(e, "roll-1") > 0  # the continued session's KV is referenced again after the flush
        # The session's real end closes it.
        async with http.post(kv + "/kvgate/sessions/roll-1/close", params={"wait": "1"}) as r:
            view = await r.json()
    assert view["state"] == "closed" and view["close_results"] == {e.url: "ok"}
    assert e.stats()["closes_received"] == 1 and refs(e, "roll-1") == 0


async def test_session_kvgate_closed_comes_back_and_is_reopened(sim_factory, router_factory, kvgate_factory):
    e = await sim_factory(**SIM)
    w = CloseWatcher(e)
    router = await router_factory([e.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, session_idle_close_s=0.2)
    turn = {"model": "kvgate-sim", "prompt": "z" * 256, "max_tokens": 4}
    async with aiohttp.ClientSession() as http:
        st, _, _ = await _post(http, kv + "/v1/completions", turn, {"X-Session-ID": "tool-1"})
        assert st == 200
        await w.wait_for("tool-1")  # idle close during a long tool call
        gw.lifecycle.policy.fixed_s = 0  # no further idle close while the test looks
        reg = gw.lifecycle.registry
        await gw.lifecycle.wait_until(lambda: reg.get("tool-1").state == "closed")
        assert refs(e, "tool-1") == 0
        st, _, _ = await _post(http, kv + "/v1/completions", {**turn, "prompt": turn["prompt"] + "w" * 40},
                               {"X-Session-ID": "tool-1"})
        assert st == 200
    s = reg.get("tool-1")
    assert s.state == "active" and s.reopened == 1 and s.turns == 2 and s.close_reason is None
    assert s.engine_closes == {} and e.stats()["closes_received"] == 1
    assert _metric(gw, "agentic_kv_session_reopened_total") == 1.0
    # SGLang 0.5.17+ re-opens a closed id on its next request and tags its KV again (session_ref_tracker.py,
    # ensure_session_generation); the simulator does the same.
    assert refs(e, "tool-1") > 0


async def test_retried_turn_keeps_its_inferred_session_and_engine(sim_factory, router_factory, kvgate_factory):
    a = await sim_factory(max_total_num_tokens=60_000, speed=20)
    b = await sim_factory(max_total_num_tokens=60_000, speed=20)
    router = await router_factory([a.url, b.url], policy="manual")
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True)
    rng = random.Random(3)
    p1 = [rng.randrange(1000, 30000) for _ in range(1000)]
    async with aiohttp.ClientSession() as http:
        st, body, h1 = await _post(http, kv + "/generate", {"input_ids": p1, "sampling_params": {
            "max_new_tokens": 1000, "ignore_eos": True}})
        assert st == 200
        sid = h1["X-Kvgate-Session-Id"]
        o1 = orjson.loads(body)["output_ids"]
        turn2 = {"input_ids": p1 + o1 + [rng.randrange(1000, 30000) for _ in range(56)],
                 "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        assert len(turn2["input_ids"]) == 2056
        # Attempt 1 of turn 2: the client gives up after its prefill (a client timeout).
        running = lambda: a.stats()["totals"]["running"] + b.stats()["totals"]["running"]  # noqa: E731
        attempt = asyncio.create_task(_post(http, kv + "/generate", turn2))
        while running() == 0:
            await asyncio.sleep(0.01)
        attempt.cancel()
        # The identical retry, at once.
        st, body, h2 = await _post(http, kv + "/generate", turn2)
    assert st == 200
    assert h2["X-Kvgate-Session-Id"] == sid  # turn 1's session, not a new one
    meta = orjson.loads(body)["meta_info"]
    print(f"retry: prompt {meta['prompt_tokens']}, cached {meta['cached_tokens']}")
    assert meta["prompt_tokens"] == 2056 and meta["cached_tokens"] >= 2050  # same engine: the prefix is cached
    inf = gw.inference.stats()
    assert inf["new"] == 1 and inf["decisive"] + inf["retry"] == 2 and inf["abandoned"] <= 1


async def test_streamed_usage_is_recorded_for_every_route_and_stream_form(sim_factory, router_factory,
                                                                          kvgate_factory):
    e = await sim_factory(**SIM)
    router = await router_factory([e.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True, session_inference=False)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count to five " * 10}]
    cases = {
        "gen-stream": ("/generate", {"input_ids": list(range(1, 101)), "stream": True,
                                     "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}),
        "cmpl-stream": ("/v1/completions", {"prompt": "p" * 100, "max_tokens": 12, "stream": True,
                                            "ignore_eos": True}),
        "cmpl-stream-usage": ("/v1/completions", {"prompt": "p" * 100, "max_tokens": 12, "stream": True,
                                                  "ignore_eos": True, "stream_options": {"include_usage": True}}),
        "chat-stream": ("/v1/chat/completions", {"messages": msgs, "max_tokens": 12, "stream": True,
                                                 "ignore_eos": True}),
        "chat-stream-usage": ("/v1/chat/completions", {"messages": msgs, "max_tokens": 12, "stream": True,
                                                       "ignore_eos": True, "stream_options": {"include_usage": True}}),
        "chat": ("/v1/chat/completions", {"messages": msgs, "max_tokens": 12, "ignore_eos": True}),
    }
    usage = {}
    async with aiohttp.ClientSession() as http:
        for sid, (path, body) in cases.items():
            st, raw, _ = await _post(http, kv + path, {"model": "kvgate-sim", **body}, {"X-Session-ID": sid})
            assert st == 200
            if sid.endswith("-usage"):
                usage[sid] = orjson.loads([x for x in raw.split(b"\n\n") if b'"usage"' in x][-1][6:])["usage"]
            elif sid == "chat":
                usage[sid] = orjson.loads(raw)["usage"]
        async with http.get(kv + "/kvgate/sessions") as r:
            view = {s["session_id"]: s for s in (await r.json())["sessions"]}
    got = {sid: (view[sid]["prompt_tokens"], view[sid]["completion_tokens"], view[sid]["usage_source"])
           for sid in cases}
    chat_prompt = usage["chat"]["prompt_tokens"]
    assert chat_prompt > 0 and usage["chat-stream-usage"]["prompt_tokens"] == chat_prompt
    assert got == {
        "gen-stream": (100, 12, "meta_info"),
        "cmpl-stream": (0, 12, "counted"),  # no usage block: one token per streamed chunk, prompt unknown
        "cmpl-stream-usage": (100, 12, "usage"),
        "chat-stream": (0, 12, "counted"),
        "chat-stream-usage": (chat_prompt, 12, "usage"),
        "chat": (chat_prompt, 12, "usage"),
    }


async def test_input_ids_with_a_non_integer_after_the_last_block_never_leak_index_entries(sim_factory,
                                                                                           kvgate_factory):
    e = await sim_factory(**SIM)
    gw, kv = await kvgate_factory(upstream=e.url, agentic_session_lifecycle=True, max_tracked_sessions=10)
    async with aiohttp.ClientSession() as http:
        for i in range(20):
            bad = list(range(i * 1000, i * 1000 + 64)) + [1.5]  # one full block, then a float
            st, _, h = await _post(http, kv + "/generate", {"input_ids": bad, "sampling_params": {"max_new_tokens": 1}})
            assert st == 400 and "X-Kvgate-Session-Id" not in h  # the engine's answer, passed through unchanged
        inf = gw.inference.stats()
        assert inf["unsupported"] == 20 and inf["tracked"] == 0 and inf["index_keys"] == 0
        assert _metric(gw, 'agentic_kv_faults_total{stage="session"}') == 0.0
        # the index still links sessions for everyone
        p = list(range(50_000, 50_200))
        st, body, h1 = await _post(http, kv + "/generate", {"input_ids": p, "sampling_params": {"max_new_tokens": 8}})
        out = orjson.loads(body)["output_ids"]
        st, _, h2 = await _post(http, kv + "/generate", {"input_ids": p + out + [5, 6],
                                                         "sampling_params": {"max_new_tokens": 8}})
    assert st == 200 and h1["X-Kvgate-Session-Id"] == h2["X-Kvgate-Session-Id"]
    assert gw.inference.stats()["decisive"] == 1 and all(t.in_flight == 0 for t in gw.inference._tracks.values())


async def test_burst_of_closes_reaches_every_engine(sim_factory, kvgate_factory, caplog):
    a, b = await sim_factory(**SIM), await sim_factory(**SIM)
    # upstream = an engine: this test is about kvgate's calls to the engines, no router needed
    gw, kv = await kvgate_factory(upstream=a.url, agentic_session_lifecycle=True, engines=[a.url, b.url],
                                  close_timeout_s=0.5)
    caplog.set_level(logging.WARNING, logger="kvgate.sessions.lifecycle")
    n = 3000
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as http:
        async def close(i):
            async with http.post(kv + "/close_session", json={"session_id": f"burst-{i}"}) as r:
                return r.status
        statuses = await asyncio.gather(*(close(i) for i in range(n)))
    answered = time.perf_counter() - t0
    reg = gw.lifecycle.registry
    await gw.lifecycle.wait_until(lambda: reg.counts()["closed"] == n, 60)
    took = time.perf_counter() - t0
    assert statuses == [200] * n
    assert reg.close_stats["ok"] == 2 * n
    # On a loaded machine an engine may answer a call after the 0.5 s timeout: kvgate counts it failed and sends
    # it again, and the engine then receives that close twice (closing is idempotent). So each engine receives
    # every close, and at most the failed attempts more; a few, not a systematic failure.
    timeouts = reg.close_stats["failed_attempts"]
    got_a, got_b = a.stats()["closes_received"], b.stats()["closes_received"]
    assert got_a >= n and got_b >= n and got_a + got_b <= 2 * n + timeouts, (got_a, got_b, timeouts)
    assert timeouts <= n // 100
    # nothing else to warn about from kvgate: its loggers, or asyncio reporting a task of kvgate's code (another
    # test's client collected meanwhile may log through asyncio about its own task)
    pkg = os.path.dirname(kvgate.__file__) + os.sep
    retried = ("/close_session failed", "answers /close_session again")  # a timed-out close, then its retry's answer
    assert not [r for r in caplog.records if (r.name.startswith("kvgate") or pkg in r.getMessage())
                and not (timeouts and any(m in r.getMessage() for m in retried))]
    print(f"{n} closes x 2 engines: answered in {answered:.2f}s ({n / answered:.0f}/s), "
          f"delivered in {took:.2f}s ({2 * n / took:.0f} engine calls/s)")


async def test_idle_close_of_many_sessions_at_once_does_not_block_kvgate(sim_factory, kvgate_factory, caplog):
    e = await sim_factory(**SIM)
    gate = await NetGate.open(e.port)
    gw, kv = await kvgate_factory(upstream=e.url, agentic_session_lifecycle=True, engines=[gate.url],
                                  session_idle_close_s=0.2, close_retry_backoff_s=0.05, close_timeout_s=0.5,
                                  close_max_rate=5000.0)
    caplog.set_level(logging.WARNING, logger="kvgate.sessions.lifecycle")
    n = 10_000
    lc = gw.lifecycle
    for i in range(n):  # sessions that ran a turn each (registered as the proxy would)
        lc.request_started(f"idle-{i}", "header")
        lc.request_finished(f"idle-{i}", None, None)
    await gate.down()  # and the engine is unreachable while the sweep closes them all
    stalls = []

    async def canary():
        # CPU time of the event loop's thread between two 5 ms ticks: what the loop ran instead of the canary.
        # Unlike wall time it does not grow when a busy machine deschedules the process.
        while True:
            t = time.thread_time()
            await asyncio.sleep(0.005)
            stalls.append(time.thread_time() - t)

    c = asyncio.create_task(canary())
    try:
        await lc.wait_until(lambda: lc.registry.close_counts()["pending"] == n, 60)
        probes = lc.registry.close_stats["failed_attempts"]
        await gate.up()
        await lc.wait_until(lambda: lc.registry.counts()["closed"] == n, 120)
    finally:
        c.cancel()
        await gate.close()
    assert e.stats()["closes_received"] == n  # each session's close delivered once the engine is back
    assert lc.registry.close_stats["given_up"] == 0
    assert probes < n / 10  # a failing engine is probed, not called once per session and retry
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) <= 4, warnings  # per engine, not per session
    print(f"idle close of {n} sessions through an outage: max event-loop CPU between ticks {max(stalls) * 1000:.0f} ms, "
          f"{probes} failed calls during the outage, {len(warnings)} warning lines")
    assert max(stalls) < 0.5


async def test_a_session_coming_back_waits_for_its_close_calls_on_the_wire(sim_factory, kvgate_factory):
    e = await sim_factory(**SIM)
    gate = await NetGate.open(e.port)
    # the turn goes to the upstream (here the engine itself), not through the frozen gate kvgate would place it on
    gw, kv = await kvgate_factory(upstream=e.url, agentic_session_lifecycle=True, engines=[gate.url],
                                  close_timeout_s=0.3, close_retry_backoff_s=30.0, session_placement="router")
    lc, reg = gw.lifecycle, gw.lifecycle.registry
    try:
        gate.freeze()  # the engine holds the close call without answering
        assert lc.close("back", "idle")
        while not lc._on_wire.get("back"):
            await asyncio.sleep(0.01)
        async with aiohttp.ClientSession() as http:
            st, _, _ = await _post(http, kv + "/generate", {"input_ids": list(range(1, 65)),
                                                            "sampling_params": {"max_new_tokens": 2}},
                                   {"X-Session-ID": "back"})
        assert st == 200
        s = reg.get("back")
        # The request went out only after the call on the wire was answered (here: timed out), then
        # re-opened the session and dropped the close it no longer wants.
        assert reg.close_stats["failed_attempts"] == 1 and reg.close_stats["cancelled"] == 1
        assert s.state == "active" and s.reopened == 1 and s.engine_closes == {}
        assert reg.close_counts() == {"sending": 0, "pending": 0}
    finally:
        await gate.close()
