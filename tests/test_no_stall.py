"""One client cannot stall the others: work proportional to a request's (or an engine's answer's) size is
bounded or off the event loop, and kvgate's own listings are paged (docs/guarantees.md).

Stalls are measured with a canary: requests sent back to back to kvgate's /kvgate/health (or ticks of the
test's own loop, for the in-process poller) while the large item is in flight; the canary starts before
and ends after it, on events, and no canary answer may take more than CANARY_MAX_S (a slow run is tried once
more: work that holds kvgate's loop holds it every time, a busy machine pausing kvgate for a moment does not).
"""

import asyncio
import hashlib
import sys
import time

import aiohttp
import orjson
import pytest
from aiohttp import web

from fake_upstream import Canary, ScriptedUpstream
from kvgate.tools import procs

CANARY_MAX_S = 0.1


async def test_a_66_mb_body_does_not_stall_other_clients(kvgate_process):
    up = await ScriptedUpstream(keep_bodies_up_to=1 << 20).start()
    try:
        kv = await kvgate_process(up.url, "--agentic-session-lifecycle")
        big = orjson.dumps({"input_ids": list(range(9_000_000)), "sampling_params": {"max_new_tokens": 1}})
        assert len(big) > 66_000_000

        async def pieces():  # the test's own loop sends in pieces too: it runs the canary
            view = memoryview(big)
            for i in range(0, len(big), 1 << 20):
                yield view[i:i + (1 << 20)]

        async def post_big():
            async with aiohttp.ClientSession() as http:
                async with http.post(kv + "/generate", data=pieces(), headers={
                        "X-Session-ID": "big", "Content-Length": str(len(big))}) as r:
                    return r.status, await r.read()

        slowest = []
        for _ in range(2):  # sent again only when the canary was slow: a body that blocks kvgate does so each time
            canary = Canary(kv + "/kvgate/health")
            status, body = await canary.around(post_big())
            assert status == 200 and body == b'{"ok":true}'
            # relayed untouched: over body_parse_max_bytes, not parsed
            assert (up.received[-1].size, up.received[-1].sha256) == (len(big), hashlib.sha256(big).hexdigest())
            slowest.append(sorted(canary.latencies)[-5:])
            if max(canary.latencies) < CANARY_MAX_S:
                break
        assert max(slowest[-1]) < CANARY_MAX_S, slowest
        async with aiohttp.ClientSession() as http:
            async with http.get(kv + "/metrics") as r:
                m = await r.text()
        assert f'agentic_kv_body_features_skipped_total{{reason="size"}} {len(slowest)}.0' in m
    finally:
        await up.close()


def _exposition(megabytes: int) -> bytes:
    """An engine /metrics of about ``megabytes`` MB: histogram noise around the three gauges kvgate reads."""
    noise = b"".join(b'sglang:e2e_request_latency_seconds_bucket{le="%d.0",model_name="m",tp_rank="0"} %d\n'
                     % (i, i) for i in range(20_000))
    gauges = (b"# TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens{dp_rank=\"0\"} 50000.0\n"
              b"# TYPE sglang:num_used_tokens gauge\nsglang:num_used_tokens{dp_rank=\"0\"} 1234.0\n"
              b"# TYPE sglang:token_usage gauge\nsglang:token_usage{dp_rank=\"0\"} 0.02468\n")
    head = b"# TYPE sglang:e2e_request_latency_seconds histogram\n"
    reps = max(2, -(-megabytes * 1_000_000 // len(noise)))
    return head + noise * (reps // 2) + gauges + noise * (reps - reps // 2)


async def _loop_ticks(stop: asyncio.Event, gaps: list[float]) -> None:
    # CPU time the event loop's thread spends between two 5 ms ticks: a parse on the loop shows as one long gap,
    # a parse in a worker thread does not, and a busy machine descheduling this process adds nothing.
    while not stop.is_set():
        t0 = time.thread_time()
        await asyncio.sleep(0.005)
        gaps.append(time.thread_time() - t0)


async def test_a_20_mb_engine_metrics_is_parsed_off_the_event_loop():
    from kvgate.admission.poller import CapacityPoller

    text = _exposition(20)
    assert len(text) > 20_000_000

    async def metrics(request):  # in pieces: this loop also runs the ticks
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        view = memoryview(text)
        for i in range(0, len(text), 1 << 20):
            await resp.write(view[i:i + (1 << 20)])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)  # /v1/loads is 404: the poller falls back to /metrics
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    poller = CapacityPoller(gate=None, directory=None, interval_s=10.0)
    poller._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    stop, gaps = asyncio.Event(), []
    ticker = asyncio.create_task(_loop_ticks(stop, gaps))
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        cap = await poller.scrape(url)
    finally:
        stop.set()
        await ticker
        await poller._session.close()
        await runner.cleanup()
    assert poller.last_sources[url] == "/metrics"
    pools = cap.pools if hasattr(cap, "pools") else None
    assert cap is not None and "50000" in repr(cap) and "1234" in repr(cap), (cap, pools)
    assert max(gaps) < CANARY_MAX_S, sorted(gaps)[-5:]


async def test_sessions_listing_is_paged_and_capped(kvgate_factory, echo_upstream):
    from kvgate.proxy.admin import SESSIONS_PAGE_MAX
    gw, url = await kvgate_factory(upstream=echo_upstream.url, agentic_session_lifecycle=True)
    n = 2 * SESSIONS_PAGE_MAX + 500
    for i in range(n):
        gw.lifecycle.request_started(f"s{i}", "body")
        gw.lifecycle.request_finished(f"s{i}", None, None)
    newest_first = [f"s{i}" for i in reversed(range(n))]
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/kvgate/sessions", params={"limit": "1000000"}) as r:
            first = await r.json()
        assert first["limit"] == SESSIONS_PAGE_MAX and first["tracked"] == n
        pages = []
        for offset in range(0, n + SESSIONS_PAGE_MAX, SESSIONS_PAGE_MAX):
            async with http.get(url + "/kvgate/sessions", params={"offset": str(offset)}) as r:
                pages.append([s["session_id"] for s in (await r.json())["sessions"]])
        async with http.get(url + "/kvgate/sessions", params={"offset": "-1"}) as r:
            assert r.status == 400
    assert [s["session_id"] for s in first["sessions"]] == newest_first[:SESSIONS_PAGE_MAX]
    assert [len(p) for p in pages] == [SESSIONS_PAGE_MAX, SESSIONS_PAGE_MAX, 500, 0]
    assert sum(pages, []) == newest_first


async def test_metrics_walk_the_session_registry_once_per_scrape(kvgate_factory, echo_upstream):
    gw, url = await kvgate_factory(upstream=echo_upstream.url, agentic_session_lifecycle=True)
    for i in range(300):
        gw.lifecycle.request_started(f"s{i}", "body")
        if i % 3:
            gw.lifecycle.request_finished(f"s{i}", None, None)
    reg = gw.lifecycle.registry
    walks = []
    original = reg.counts

    def counting():
        walks.append(1)
        return original()

    reg.counts = counting
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.get(url + "/metrics") as r:
                m = await r.text()
    assert len(walks) == 2  # one walk per scrape, whatever the number of sessions or states
    assert 'agentic_kv_sessions{state="active"} 300.0' in m and 'agentic_kv_sessions{state="closed"} 0.0' in m


class _Chunks:
    def __init__(self, data: bytes, size: int):
        self.pieces = [data[i:i + size] for i in range(0, len(data), size)]

    async def readany(self) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""


async def test_engine_metrics_gauge_lines_survive_any_chunking():
    from kvgate.admission.poller import _gauge_lines, _parse_metrics_bytes
    text = (b"# HELP sglang:token_usage The token usage\n# TYPE sglang:token_usage gauge\n"
            b'sglang:token_usage{dp_rank="0"} 0.5\nother_metric ' + b"9" * 70_000 + b"\n"
            b'sglang:max_total_num_tokens{dp_rank="0"} 1000.0\nsglang:num_used_tokens{dp_rank="0"} 500.0')
    want = b'# HELP sglang:token_usage The token usage\n# TYPE sglang:token_usage gauge\n' \
           b'sglang:token_usage{dp_rank="0"} 0.5\nsglang:max_total_num_tokens{dp_rank="0"} 1000.0\n' \
           b'sglang:num_used_tokens{dp_rank="0"} 500.0\n'
    for size in (1, 7, 64, 4096, 65_536, len(text)):
        assert await _gauge_lines(_Chunks(text, size)) == want, size
    cap = _parse_metrics_bytes(want)
    assert (cap.capacity, cap.used) == (1000, 500)
