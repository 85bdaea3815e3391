"""The program policy counts engines' HiCache host pools: the host pool read from /server_info (pure rule),
the ledger's ceilings with and without it, the replicas' wire format, and end to end on simulated engines
with the host tier (kvgate -> real smg -> sim engine)."""

import asyncio

import aiohttp
import orjson
import pytest

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity, host_pool_tokens
from kvgate.admission.ledger import Ledger
from kvgate.admission.program import ProgramState


def _info(**kw):
    base = {"max_total_num_tokens": 100_000, "enable_hierarchical_cache": True, "hicache_ratio": 2.0,
            "hicache_size": 0, "internal_states": [{"memory_usage": {"token_capacity": 100_000, "kvcache": 12.21}}]}
    base.update(kw)
    return base


def test_host_pool_follows_sglangs_sizing_rule_and_adds_what_the_device_does_not_hold():
    # write_through (SGLang's default): the host pool keeps a copy of the device's KV, so it adds host - device;
    # host = --hicache-ratio x the device pool (SGLang's default ratio is 2.0)
    assert host_pool_tokens(_info()) == 100_000
    assert host_pool_tokens(_info(hicache_ratio=3.5)) == 250_000
    assert host_pool_tokens(_info(hicache_ratio=None)) == 100_000
    assert host_pool_tokens(_info(hicache_ratio=0.5)) == 0  # smaller than the device: a subset of its KV
    assert host_pool_tokens(_info(hicache_write_policy="write_through_selective")) == 100_000
    # write_back: the host holds only what the device evicted, so the whole pool adds
    assert host_pool_tokens(_info(hicache_write_policy="write_back")) == 200_000
    assert host_pool_tokens(_info(hicache_write_policy="write_back", hicache_ratio=0.5)) == 50_000
    # --hicache-size GB (10^9 bytes) over the KV bytes per token (kvcache GiB / token_capacity)
    per_token = 12.21 * 1024 ** 3 / 100_000
    assert int(50e9 / per_token) == 381_376
    assert host_pool_tokens(_info(hicache_size=50)) == 281_376
    assert host_pool_tokens(_info(hicache_size=50, hicache_write_policy="write_back")) == 381_376
    # no HiCache: no host pool; an answer that does not say: unknown
    assert host_pool_tokens(_info(enable_hierarchical_cache=False)) == 0
    assert host_pool_tokens({"max_total_num_tokens": 100_000}) is None
    assert host_pool_tokens(_info(hicache_size=50, internal_states=[])) is None  # GB without bytes per token
    assert host_pool_tokens(_info(max_total_num_tokens=None, internal_states=[])) is None
    assert host_pool_tokens(_info(hicache_ratio=1e30)) is None  # implausible
    assert host_pool_tokens(["not", "a", "mapping"]) is None


def _snapshot(host=0, dp=1):
    cap = EngineCapacity.from_pools([(10_000, 0, 0.0)] * dp).with_host(host)
    return ClusterSnapshot.build({"http://e0": cap, "http://e1": EngineCapacity.from_pools([(10_000, 0, 0.0)])}, 0.0)


def test_ledger_ceilings_count_the_host_pool_only_when_asked():
    snap = _snapshot(host=20_000)
    assert snap.host == 20_000 and snap.engines["http://e0"].host == 20_000
    plain, host = Ledger(headroom=0.9), Ledger(headroom=0.9, count_host=True)
    for led in (plain, host):
        led.reconcile(snap, 0.0)
    assert plain.ceiling == 18_000 and plain.ceiling_of("http://e0") == 9_000
    assert host.ceiling == 36_000 and host.ceiling_of("http://e0") == 27_000 and host.ceiling_of("http://e1") == 9_000
    # one reservation is still clamped to the device pool
    assert host.max_tokens("http://e0") == 10_000
    # 20,000 tokens on e0: over its device ceiling, within device + host
    assert not plain.try_acquire("a", 9_500, 0.0, place="http://e0") or plain.reserved_on("http://e0") == 9_500
    for i in range(2):
        assert host.try_acquire(f"h{i}", 10_000, 0.0, place="http://e0")
    assert host.reserved_on("http://e0") == 20_000
    assert not host.try_acquire("h3", 10_000, 0.0, place="http://e0")  # 30,000 > 27,000
    # per DP rank: each rank has its own host pool
    dp = Ledger(headroom=1.0, count_host=True)
    dp.reconcile(_snapshot(host=5_000, dp=2), 0.0)
    assert dp.ceiling_of(("http://e0", 1)) == 15_000 and dp.ceiling_of("http://e0") == 30_000


def test_the_host_pool_crosses_the_replicas_wire_and_old_wire_still_reads():
    snap = _snapshot(host=20_000)
    back = ClusterSnapshot.from_wire(orjson.loads(orjson.dumps(snap.to_wire())), 1.0)
    assert back.engines["http://e0"].host == 20_000 and back.host == 20_000
    old = {"engines": {"http://e0": [[10_000, 5, 0.0005]]}, "unhealthy": []}
    assert ClusterSnapshot.from_wire(old, 1.0).engines["http://e0"].host == 0
    assert ClusterSnapshot.from_wire({"engines": {"http://e0": [[1, 2]]}, "unhealthy": []}, 1.0) is None


POLL = 0.1


async def _turn(http, kv, sid, ids, max_new=200):
    body = {"session_id": sid, "input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}
    async with http.post(kv + "/generate", data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as r:
        payload = orjson.loads(await r.read())
        return r.status, r.headers.get("X-Kvgate-Admission"), payload


async def _fleet(sim_factory, router_factory, kvgate_factory, policy="program", **kw):
    e = await sim_factory(max_total_num_tokens=2000, speed=4.0, enable_hierarchical_cache=True)
    router = await router_factory([e.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_program_admission=True, admission_policy=policy, admission_pause_start_ratio=0,
                                  agentic_session_lifecycle=True, session_inference=False,
                                  admission_poll_interval_s=POLL, discovery_interval_s=0.2,
                                  agentic_admission_max_wait_s=60.0, **kw)
    gw.engine_of = lambda sid: (e.url, None)  # every session goes to this engine
    await gw.directory.first_refresh.wait()
    while gw.gate.ledger.snapshot is None or gw.gate.ledger.ceiling == 0:
        await gw.poller.round_done.wait()
    return e, gw, kv


@pytest.mark.parametrize("host_cache", [True, False])
async def test_program_policy_starts_a_program_the_host_pool_can_hold(sim_factory, router_factory, kvgate_factory,
                                                                      host_cache):
    """Two programs in a tool call hold 1,600 of the device ceiling (2,000 x 0.9); a third program's first turn
    (800) fits only when the engine's HiCache host pool counts (2 x 2,000 at SGLang's default ratio, written
    through: it adds 2,000 beyond the device's own)."""
    e, gw, kv = await _fleet(sim_factory, router_factory, kvgate_factory, admission_host_cache=host_cache)
    co = gw.gate.coord
    async with aiohttp.ClientSession() as http:
        async with http.get(e.url + "/sim/stats") as r:
            host = (await r.json())["totals"]["hicache_host_total_tokens"]
        assert host == 4000
        assert gw.gate.ledger.ceiling == (int((2000 + 2000) * 0.9) if host_cache else 1800)
        assert gw.poller.host_tokens == ({e.url: 2000} if host_cache else {})
        for sid, base in (("A", 10_000), ("B", 20_000)):
            st, dec, _ = await _turn(http, kv, sid, list(range(base, base + 600)))
            assert (st, dec) == (200, "admit") and co.state_of(sid) is ProgramState.IN_TOOL
        assert gw.gate.ledger.reserved == 1600
        c = asyncio.create_task(_turn(http, kv, "C", list(range(30_000, 30_600))))
        if host_cache:
            st, dec, out = await c
            assert (st, dec) == (200, "admit") and len(out["output_ids"]) == 200
            assert co.pauses == {} and gw.gate.ledger.reserved == 2400
        else:
            await gw.gate.wait_until(lambda: co.waiting == 1, 15.0)
            c.cancel()
            await asyncio.gather(c, return_exceptions=True)


async def test_fifo_policy_never_counts_the_host_pool(sim_factory, router_factory, kvgate_factory):
    e, gw, kv = await _fleet(sim_factory, router_factory, kvgate_factory, policy="fifo")
    assert gw.gate.ledger.ceiling == 1800 and not gw.gate.ledger.count_host


async def test_host_pool_set_in_gb_is_read_through_the_kv_bytes_per_token(sim_factory, router_factory,
                                                                          kvgate_factory):
    e = await sim_factory(max_total_num_tokens=200_000, speed=4.0, enable_hierarchical_cache=True, hicache_size=40)
    router = await router_factory([e.url])
    gw, kv = await kvgate_factory(upstream=router, agentic_program_admission=True, admission_policy="program", admission_pause_start_ratio=0,
                                  admission_poll_interval_s=POLL, discovery_interval_s=0.2)
    await gw.directory.first_refresh.wait()
    while e.url not in gw.poller.host_tokens:
        await gw.poller.round_done.wait()
    async with aiohttp.ClientSession() as http:
        async with http.get(e.url + "/sim/stats") as r:
            actual = (await r.json())["totals"]["hicache_host_total_tokens"]
    # kvcache is reported in GiB to 2 decimals: the bytes per token, hence the pool, within 0.1%; written
    # through, it adds what is beyond the device's 200,000
    assert actual == 40e9 // (131072) and abs(gw.poller.host_tokens[e.url] - (actual - 200_000)) <= actual * 0.001
    async with aiohttp.ClientSession() as http:
        async with http.get(kv + "/kvgate/stats") as r:
            stats = await r.json()
    assert stats["ledger"]["host_cache_tokens"] == gw.poller.host_tokens[e.url]
    assert stats["ledger"]["ceiling"] == int((200_000 + gw.poller.host_tokens[e.url]) * 0.9)


async def test_an_engine_whose_answer_does_not_say_is_asked_again_after_a_while():
    """/server_info asks the engine's scheduler: an engine that gave no HiCache figures is not asked every poll."""
    from types import SimpleNamespace

    from conftest import ManualClock
    from kvgate.admission import poller as pm

    clock = ManualClock(0.0)
    p = pm.CapacityPoller(SimpleNamespace(ledger=SimpleNamespace(count_host=True)), None, 2.0, clock=clock)
    assert p.count_host
    answers, asked = [None, 500], []

    async def fake(url):
        asked.append(url)
        return answers.pop(0)

    p._host_pool = fake
    await p._read_host_pools(["http://e0"])
    assert p.host_tokens == {} and asked == ["http://e0"]
    clock.t = pm.HOST_RETRY_S - 1
    await p._read_host_pools(["http://e0"])           # not yet
    assert asked == ["http://e0"]
    clock.t = pm.HOST_RETRY_S
    await p._read_host_pools(["http://e0"])
    assert p.host_tokens == {"http://e0": 500} and len(asked) == 2
    await p._read_host_pools(["http://e0"])           # read once: never asked again
    assert len(asked) == 2
    await p._read_host_pools([])                      # left the list: forgotten (read again if it comes back)
    assert p.host_tokens == {}
