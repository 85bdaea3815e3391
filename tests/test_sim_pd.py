"""The simulator as prefill and decode workers (SGLang's --disaggregation-mode) behind the real smg 1.13 PD router:
the rendezvous, the decode worker as a session's home, each role's own figures, and the bootstrap room rules."""

import asyncio
import sys

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvgate.sim import disagg
from kvgate.tools import procs


@given(room=st.integers(0, 2**63 - 1), count=st.integers(1, 16))
def test_one_room_numbers_each_sequence_from_it(room, count):
    """An int room gives sequence i the room + i (SGLang io_struct.py); a list of k rooms repeats for n samples."""
    assert disagg.rooms_of({"bootstrap_room": room}, count) == [room + i for i in range(count)]
    rooms = [room, room + 7]
    assert disagg.rooms_of({"bootstrap_room": rooms}, 2 * count) == rooms * count


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(room=st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.floats(), st.just([]),
                      st.lists(st.one_of(st.text(max_size=2), st.booleans()), min_size=1, max_size=3)))
def test_a_missing_or_malformed_room_is_a_clear_error(room):
    """No room, or a room that is no int or list of ints: ValueError naming it, never a crash."""
    with pytest.raises(ValueError, match="bootstrap room|bootstrap_room"):
        disagg.rooms_of({"bootstrap_room": room}, 1)


def test_transfer_time_scales_with_tokens_and_speed():
    assert disagg.transfer_seconds(2000, 5.0, 1.0) == pytest.approx(0.01)
    assert disagg.transfer_seconds(2000, 5.0, 10.0) == pytest.approx(0.001)
    assert disagg.transfer_seconds(-3, 5.0, 1.0) == 0


async def _generate(http, url, ids, sid=None, **extra):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}, **extra}
    headers = {}
    if sid:
        body["session_id"] = sid
        headers["X-SMG-Routing-Key"] = sid
    async with http.post(url + "/generate", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.json(), r.headers.get("x-smg-routed-worker-id")


async def test_a_session_lives_on_its_decode_worker_behind_smg_pd(pd_fleet):
    """Three turns of one session through smg's PD router (consistent_hashing on the routing key): every turn is
    prefilled on the prefill worker and decoded on one decode worker, whose radix cache holds the session (cached
    tokens grow); only the part the decode worker lacks is transferred; the other decode worker sees nothing."""
    router, (pre,), decs = await pd_fleet(prefill=1, decode=2)
    prompt = list(range(1, 1001))
    cached, routed = [], set()
    async with aiohttp.ClientSession() as http:
        for turn in range(3):
            out, worker = await _generate(http, router, prompt, sid="s-pd")
            cached.append(out["meta_info"]["cached_tokens"])
            routed.add(worker)
            assert out["meta_info"]["completion_tokens"] == 8
            prompt = prompt + out["output_ids"] + [500 + turn] * 50
    home = [d for d in decs if d.url in routed]
    assert len(routed) == 1 and len(home) == 1
    (home,) = home
    other = next(d for d in decs if d is not home)
    assert cached[0] == 0 and cached[0] < cached[1] < cached[2]
    assert cached[1] == 1000 + 8 - 1 and cached[2] == 1000 + 8 + 50 + 8 - 1
    hs, ps, os_ = home.stats(), pre.stats(), other.stats()
    assert hs["sessions"] == {"s-pd": 3} and ps["sessions"] == {"s-pd": 3} and os_["sessions"] == {}
    assert hs["pd_rooms"] == 3 and ps["pd_rooms"] == 3
    # turn 1: the whole prompt; later turns: what the decode cache lacked (the last token of each turn plus the
    # new observation)
    assert hs["pd_transferred_tokens"] == 1000 + (1058 - 1007) + (1116 - 1065)
    assert ps["totals"]["generation_tokens"] == 3  # the prefill worker stops at the first token
    assert hs["totals"]["generation_tokens"] == 24


async def test_each_role_reports_its_own_metrics_and_loads(pd_fleet):
    """/metrics carries SGLang's engine_type label per role; /v1/loads and /server_info say the role."""
    router, (pre,), (dec,) = await pd_fleet(prefill=1, decode=1)
    async with aiohttp.ClientSession() as http:
        await _generate(http, router, list(range(1, 300)))
        for h, role in ((pre, "prefill"), (dec, "decode")):
            async with http.get(h.url + "/metrics") as r:
                text = await r.text()
            assert f'engine_type="{role}"' in text and 'engine_type="unified"' not in text
            async with http.get(h.url + "/server_info") as r:
                assert (await r.json())["disaggregation_mode"] == role
            async with http.get(h.url + "/v1/loads") as r:
                (load,) = (await r.json())["loads"]
            assert load["max_total_num_tokens"] == 50_000
        # the decode worker holds the finished request (prompt + output) in its radix cache, the prefill worker
        # the prompt it prefilled plus its one token
        assert dec.stats()["totals"]["evictable"] == 299 + 8 - 1
        assert pre.stats()["totals"]["evictable"] == 299


async def test_a_request_without_a_room_gets_sglangs_400(sim_factory):
    """Sent to a PD worker directly (no router): 400 with SGLang 0.5.23's message, on both roles and routes."""
    pre = await sim_factory(disaggregation_mode="prefill", disaggregation_bootstrap_port=procs.free_port())
    dec = await sim_factory(disaggregation_mode="decode")
    async with aiohttp.ClientSession() as http:
        for h in (pre, dec):
            for path, body in (("/generate", {"input_ids": [1, 2, 3]}),
                               ("/v1/completions", {"model": "kvgate-sim", "prompt": "hi"})):
                async with http.post(h.url + path, json=body) as r:
                    assert r.status == 400
                    assert (await r.json())["error"]["message"] == disagg.NO_ROOM_MESSAGE
    assert pre.stats()["totals"]["num_requests"] == 0 and dec.stats()["totals"]["num_requests"] == 0


async def test_a_decode_request_whose_prefill_fails_is_aborted_not_hung(sim_factory):
    """The prefill of a room fails (its prompt does not fit the prefill worker's pool): the decode worker's
    wait ends at once with a 500 naming the transfer, instead of waiting out the bootstrap timeout."""
    bport = procs.free_port()
    pre = await sim_factory(disaggregation_mode="prefill", disaggregation_bootstrap_port=bport,
                            max_total_num_tokens=100)
    dec = await sim_factory(disaggregation_mode="decode", disaggregation_bootstrap_timeout_s=30)
    body = {"input_ids": list(range(1, 200)), "bootstrap_host": "127.0.0.1", "bootstrap_port": bport,
            "bootstrap_room": 42}
    async with aiohttp.ClientSession() as http:
        async def leg(url):
            async with http.post(url + "/generate", json=body) as r:
                return r.status, await r.json()
        (ps, _), (ds, dbody) = await asyncio.wait_for(asyncio.gather(leg(pre.url), leg(dec.url)), 10)
    assert ps == 400 and ds == 500
    assert "KV transfer failed" in dbody["error"]["message"] and "42" in dbody["error"]["message"]


def test_cli_refuses_a_decode_worker_without_its_radix_cache():
    import subprocess
    out = subprocess.run([sys.executable, "-m", "kvgate.sim.args", "--disaggregation-mode", "decode"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "--disaggregation-decode-enable-radix-cache" in out.stderr
