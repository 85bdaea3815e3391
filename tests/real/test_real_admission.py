"""Admission on real engines: the capacity figures kvgate reads, and a request held while the real KV pools are
full and let go when room frees."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from .conftest import POOL
from .helpers import engine_metrics, gen_body, get_json, ids, post

ADMISSION = dict(agentic_session_lifecycle=True, agentic_program_admission=True, admission_poll_interval_s=0.2,
                 discovery_interval_s=0.5, session_placement="kvgate", agentic_admission_max_wait_s=120.0)


async def _ready(gw) -> None:
    """Until the ledger has figures from every engine the router lists."""
    await gw.directory.first_refresh.wait()
    while gw.gate.ledger.snapshot is None or len(gw.gate.ledger.snapshot.engines) < len(gw.directory.urls):
        await gw.poller.round_done.wait()


@pytest.mark.parametrize("source", ["loads", "metrics"])
async def test_capacity_figures_are_the_engines_max_total_num_tokens(fleet, kvgate_factory, source):
    gw, kv = await kvgate_factory(upstream=fleet.smg, admission_capacity_source=source, **ADMISSION)
    await _ready(gw)
    async with aiohttp.ClientSession() as http:
        loads = [await get_json(http, u + "/v1/loads") for u in fleet.urls]
        gauges = [await engine_metrics(http, u) for u in fleet.urls]
        stats = await get_json(http, kv + "/kvgate/stats")
    reported = [ld["loads"][0]["max_total_num_tokens"] for ld in loads]
    assert reported == [POOL] * len(fleet.urls) == [g["sglang:max_total_num_tokens"] for g in gauges]
    snap = gw.gate.ledger.snapshot
    assert {u: snap.engines[u].capacity for u in fleet.urls} == dict(zip(fleet.urls, reported))
    assert {u: len(snap.engines[u].pools) for u in fleet.urls} == {u: 1 for u in fleet.urls}  # no DP
    assert set(gw.poller.last_sources.values()) == {"/v1/loads" if source == "loads" else "/metrics"}
    # The ledger commits agentic_admission_headroom (0.9) of the fleet's pools.
    assert stats["ledger"]["ceiling"] == int(0.9 * len(fleet.urls) * POOL)


async def _timed(http, url, body, headers):
    t0 = time.monotonic()
    st, obj, h = await post(http, url, body, headers)
    assert st == 200, obj
    return t0, time.monotonic(), obj, h


async def test_held_while_an_engine_pool_is_full_let_go_when_it_empties(fleet, kvgate_factory):
    """Work kvgate does not see (sent straight to engine 0) fills that engine's pool past the pressure threshold:
    kvgate reads it in the engine's own figures and holds a new call until the engine reports room again."""
    # The router places the call (no engine known to kvgate): the guard reads the worst engine's usage. (A call
    # kvgate placed would be checked against its own engine's usage, and placed on the emptier one.)
    gw, kv = await kvgate_factory(upstream=fleet.smg, agentic_admission_pressure_threshold=0.5,
                                  **{**ADMISSION, "session_placement": "router"})
    await _ready(gw)
    usage: list[tuple[float, float]] = []  # (when, worst engine token_usage) per snapshot kvgate took
    gw.poller.listeners.append(lambda s: usage.append((time.monotonic(), s.worst_usage)))
    async with aiohttp.ClientSession() as http:
        # 2,600 prompt + 300 new tokens: 0.65-0.73 of a 4,000-token pool while it runs
        big = asyncio.create_task(_timed(http, fleet.urls[0] + "/generate", gen_body(ids(2600, 7), 300), {}))
        while not any(u >= 0.5 for _, u in usage):  # kvgate has seen the pool past the threshold
            assert not big.done(), "the big request ended before kvgate saw its KV"
            await gw.poller.round_done.wait()
        t_sent, t_done, held, h = await _timed(http, kv + "/generate", gen_body(ids(50, 8), 4), {})
        big_t0, big_t1, big_obj, _ = await big
    assert big_obj["meta_info"]["completion_tokens"] == 300
    assert h["X-Kvgate-Admission"] == "admit"
    # Held for as long as the engine reported its pool full: the engine received it only after the big request
    # had ended (both times are the engine's own, meta_info's wall clock).
    assert int(h["X-Kvgate-Queue-Ms"]) > 0
    assert held["meta_info"]["request_received_ts"] >= big_obj["meta_info"]["request_finished_ts"], (held, big_obj)
    assert gw.gate.stats()["counters"]["wait"] >= 1


async def test_ledger_holds_the_call_that_would_overfill_the_pools(fleet, kvgate_factory):
    """Calls of 3,000 prompt + 400 new tokens, one per engine and one more: one per engine fits the ledger's
    0.9 x 4,000 per engine (7,200 for two), the last waits until one of the others has finished."""
    gw, kv = await kvgate_factory(upstream=fleet.smg, **ADMISSION)
    await _ready(gw)
    n = len(fleet.urls)
    async with aiohttp.ClientSession() as http:
        first = [asyncio.create_task(_timed(http, kv + "/generate", gen_body(ids(3000, 20 + i), 400),
                                            {"X-Session-ID": f"big{i}"})) for i in range(n)]
        while gw.gate.stats()["counters"]["admit"] < n:
            await asyncio.sleep(0.05)  # the two leases are granted as their requests arrive
        third = asyncio.create_task(_timed(http, kv + "/generate", gen_body(ids(3000, 30), 400),
                                           {"X-Session-ID": "last"}))
        while gw.gate.stats()["waiting"] < 1:
            assert not third.done()
            await asyncio.sleep(0.05)
        done = await asyncio.gather(*first)
        t_sent, _, obj, h = await third
    assert [d[3]["X-Kvgate-Admission"] for d in done] == ["admit"] * n
    assert [int(d[3]["X-Kvgate-Queue-Ms"]) for d in done] == [0] * n
    assert h["X-Kvgate-Admission"] == "admit" and obj["meta_info"]["completion_tokens"] == 400
    assert int(h["X-Kvgate-Queue-Ms"]) > 0
    # the engine received it only after one of the others had ended (the engine's own clock)
    first_end = min(d[2]["meta_info"]["request_finished_ts"] for d in done)
    assert obj["meta_info"]["request_received_ts"] >= first_end, (obj["meta_info"], first_end)
    # kvgate spread the big sessions over the engines (free KV), so none queued in an engine.
    assert {gw.placement.engine_of(f"big{i}")[0] for i in range(n)} == set(fleet.urls)


async def test_one_turn_jobs_never_wait_out_the_aging_bound_beside_kv_they_no_longer_use(fleet, kvgate_factory):
    """Seven one-turn jobs (no session ids: lifecycle infers a session for each) of 1,500 prompt + 300 new
    tokens sharing a 300-token system prompt, on two engines of 4,000 tokens (ceilings 3,600: two jobs each).
    Before: a finished job's inferred session counted as a program in a tool call for 60 s (no gap evidence
    yet), holding its KV in the ledger, so the last three jobs waited the full overdue time beside engines whose
    jobs had ended. Now its KV is held without evidence of return, and a turn that has waited one poll interval
    reclaims it: every job is admitted (none aged) and none waits much longer than the jobs ahead of it run."""
    # the program policy's rules whatever re-prefill costs (the pause gate off)
    gw, kv = await kvgate_factory(upstream=fleet.smg, admission_policy="program", admission_pause_start_ratio=0,
                                  **ADMISSION)
    await _ready(gw)
    system = ids(300, 90)
    async with aiohttp.ClientSession() as http:
        jobs = await asyncio.gather(*(_timed(http, kv + "/generate", gen_body(system + ids(1200, 91 + i), 300), {})
                                      for i in range(7)))
    decisions = [h["X-Kvgate-Admission"] for *_, h in jobs]
    queued_s = [int(h["X-Kvgate-Queue-Ms"]) / 1000 for *_, h in jobs]
    first_wave_s = [t1 - t0 for (t0, t1, _, h), q in zip(jobs, queued_s) if q == 0]
    assert decisions == ["admit"] * 7, decisions
    assert all(obj["meta_info"]["completion_tokens"] == 300 for _, _, obj, _ in jobs)
    assert len(first_wave_s) == 4, queued_s  # two jobs per engine fit at once
    counters = gw.gate.stats()["counters"]
    assert counters["reclaimed"] >= 1 and counters["bypass_aged"] == 0, counters
    # The other three waited only for the first four to end (plus a poll or two for the engines' figures).
    # Before, they waited out the 60 s overdue default.
    assert max(queued_s) <= max(first_wave_s) + 2.0, (queued_s, first_wave_s)


async def test_a_new_program_placed_on_a_full_engine_goes_to_the_empty_one_at_once(fleet, kvgate_factory):
    """An agent ("home") holds 3,200 tokens of its 2-turn context on engine A (ceiling 3,600) between turns. A
    new program whose prompt starts with home's first prompt would go to A by prefix affinity, where its
    3,400-token first turn does not fit, while engine B is empty. Before: it waited in kvgate until home's
    program counted as ended (60 s). Then admission admitted it on B at once and moved the session there; now
    placement's projected KV (home's 3,200 held + 3,400 less the shared 1,500) sends it to B itself."""
    if len(fleet.urls) < 2:
        pytest.skip("needs two engines")
    # prefix affinity up to 0.95 usage, so home's 0.8 cannot move the new program off its engine by itself
    gw, kv = await kvgate_factory(upstream=fleet.smg, placement_pressure_threshold=0.95, admission_policy="program",
                                  admission_pause_start_ratio=0, **ADMISSION)
    await _ready(gw)
    first = ids(1500, 70)
    async with aiohttp.ClientSession() as http:
        st, t1, _ = await post(http, kv + "/generate", gen_body(first, 100), {"X-Session-ID": "home"})
        assert st == 200, t1
        second = first + t1["output_ids"] + ids(1500, 71)
        st, t2, h2 = await post(http, kv + "/generate", gen_body(second, 100), {"X-Session-ID": "home"})
        assert st == 200 and h2["X-Kvgate-Admission"] == "admit", t2
        home = gw.placement.engine_of("home")[0]
        await gw.poller.round_done.wait()  # the engines' figures after home's second turn
        st, obj, h = await post(http, kv + "/generate", gen_body(first + ids(1800, 72), 100), {"X-Session-ID": "new"})
        async with http.get(kv + "/kvgate/sessions/new") as r:
            new = await r.json()
    assert st == 200 and obj["meta_info"]["completion_tokens"] == 100
    assert (h["X-Kvgate-Admission"], h["X-Kvgate-Queue-Ms"]) == ("admit", "0")
    other = next(u for u in fleet.urls if u != home)
    assert new["engine"]["url"] == other and new["engine"]["moves"] == 0, new
    assert gw.placement.counts["kv_moved"] == 1 and gw.gate.stats()["counters"]["moved"] == 0
    assert gw.gate.ledger.reserved_on(home) >= 3000  # home still holds its context there: nothing was paused
    assert gw.gate.stats()["counters"]["pause"] == 0
