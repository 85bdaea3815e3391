"""Prometheus text of the simulator: names, labels, tp copies, dp ranks, rounding."""

import re

import aiohttp

from kvgate.sim.exposition import RankSnapshot, render
from kvgate.sim.http_api import start_sim_engine

LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\} (\S+)$')


def parse(text):
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = LINE.match(line)
        assert m, line
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2))))
        key = (m.group(1), labels)
        assert key not in out, f"duplicate series {key}"
        out[key] = float(m.group(3))
    return out


def snap(rank=0, used=333, total=1000):
    return RankSnapshot(dp_rank=rank, max_total_num_tokens=total, num_used_tokens=used,
                        available=total - used - 100, evictable=100, num_running_reqs=2,
                        num_queue_reqs=1, cache_hit_rate=0.5, num_retracted_reqs=0,
                        new_token_ratio=0.7, retracted_total=3, evicted_total=42,
                        prompt_tokens_total=10, generation_tokens_total=20,
                        cached_tokens_total=5, num_requests_total=2, aborted_total=1)


def values(series, name):
    return {dict(k[1]).get("tp_rank") + "/" + dict(k[1]).get("dp_rank", "-"): v
            for k, v in series.items() if k[0] == name}


def test_names_labels_rounding_and_no_created():
    text = render([snap()], model_name="m")
    assert "_created" not in text
    s = parse(text)
    lab = (("engine_type", "unified"), ("model_name", "m"), ("moe_ep_rank", "0"),
           ("pp_rank", "0"), ("tp_rank", "0"))
    assert s[("sglang:token_usage", lab)] == 0.33
    assert 'sglang:token_usage{engine_type="unified",model_name="m",moe_ep_rank="0",' \
           'pp_rank="0",tp_rank="0"} 0.33' in text
    assert s[("sglang:num_used_tokens", lab)] == 333
    assert s[("sglang:kv_available_tokens", lab)] == 567
    assert s[("sglang:kv_evictable_tokens", lab)] == 100
    assert s[("sglang:max_total_num_tokens", lab)] == 1000
    assert s[("sglang:num_retracted_requests_total", lab)] == 3
    assert s[("sglang:evicted_tokens_total", tuple(sorted(lab + (("cache_type", "device"),))))] \
        == 42
    assert s[("sglang:num_aborted_requests_total", lab)] == 1
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:cache_hit_rate",
                 "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                 "sglang:cached_tokens_total", "sglang:num_requests_total",
                 "sglang:time_to_first_token_seconds_count",
                 "sglang:e2e_request_latency_seconds_count"):
        assert any(k[0] == name for k in s), name
    assert any(k[0] == "sglang:num_retracted_reqs" and dict(k[1]).get("pid") for k in s)
    assert round(0.666, 2) == 0.67 and render([snap(used=666)]).count(" 0.67\n") == 2


def test_tp_copies_are_identical():
    s = parse(render([snap()], tp_copies=3))
    for name in ("sglang:num_used_tokens", "sglang:kv_evictable_tokens",
                 "sglang:evicted_tokens_total", "sglang:e2e_request_latency_seconds_bucket"):
        rows = {}
        for (n, labels), v in s.items():
            if n == name:
                d = dict(labels)
                tp = d.pop("tp_rank")
                rows.setdefault(tuple(sorted(d.items())), {})[tp] = v
        assert rows
        for per_tp in rows.values():
            assert sorted(per_tp) == ["0", "1", "2"] and len(set(per_tp.values())) == 1


async def test_dp2_separate_pools_and_labels():
    h = await start_sim_engine(max_total_num_tokens=1000, dp_size=2, speed=1000.0)
    try:
        async with aiohttp.ClientSession() as cs:
            r = await cs.post(h.url + "/generate", json={
                "input_ids": list(range(10, 110)), "routed_dp_rank": 1,
                "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
            out = await r.json()
            assert out["meta_info"]["dp_rank"] == 1
            text = await (await cs.get(h.url + "/metrics")).text()
            loads = (await (await cs.get(h.url + "/v1/loads")).json())["loads"]
        s = parse(text)
        ev = values(s, "sglang:kv_evictable_tokens")
        assert ev == {"0/0": 0.0, "0/1": 104.0}
        assert values(s, "sglang:kv_available_tokens") == {"0/0": 1000.0, "0/1": 896.0}
        assert values(s, "sglang:max_total_num_tokens") == {"0/0": 1000.0, "0/1": 1000.0}
        assert values(s, "sglang:prompt_tokens_total") == {"0/0": 0.0, "0/1": 100.0}
        assert values(s, "sglang:generation_tokens_total") == {"0/0": 0.0, "0/1": 5.0}
        assert [(ld["dp_rank"], ld["kv_evictable_tokens"]) for ld in loads] == [(0, 0), (1, 104)]
        st = h.stats()
        assert [rk["evictable"] for rk in st["ranks"]] == [0, 104]
    finally:
        await h.close()


async def test_disable_metrics_404():
    h = await start_sim_engine(max_total_num_tokens=1000, disable_metrics=True)
    try:
        async with aiohttp.ClientSession() as cs:
            r = await cs.get(h.url + "/metrics")
            assert r.status == 404
            r = await cs.get(h.url + "/v1/loads?format=prometheus")
            text = await r.text()
            assert 'sglang:load_max_total_num_tokens{dp_rank="0"} 1000.0' in text
    finally:
        await h.close()
