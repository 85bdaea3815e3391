"""Capacity signal parsing: SGLang's GET /metrics gauges (python/sglang/srt/observability/metrics_collector.py)
and GET /v1/loads (python/sglang/srt/entrypoints/v1_loads.py)."""

import math

import orjson
import pytest

from kvgate.admission.capacity import (
    ClusterSnapshot,
    EngineCapacity,
    Pool,
    parse_engine_loads,
    parse_engine_metrics,
    stale_after_s,
)


def _labels(dp, tp, extra=""):
    dp_part = f'dp_rank="{dp}",' if dp is not None else ""
    return f'{dp_part}engine_type="unified",model_name="qwen3-8b",moe_ep_rank="0",pp_rank="0",tp_rank="{tp}"{extra}'


def sglang_metrics(pools, tp=1, with_dp=True, extra_families=True):
    """Realistic SGLang multiprocess-format /metrics text. pools: [(max_total, used, usage)] per dp rank;
    every tp rank exports an identical copy (as with --enable-metrics-for-all-schedulers)."""
    out = []
    pid_extra = ',pid="4242"'
    fams = [
        ("sglang:max_total_num_tokens", "Maximum total number of tokens", 0),
        ("sglang:num_used_tokens", "The number of used tokens", 1),
        ("sglang:token_usage", "The token usage", 2),
    ]
    for name, help_, idx in fams:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} gauge")
        for dp, pool in enumerate(pools):
            for t in range(tp):
                v = pool[idx]
                out.append(f"{name}{{{_labels(dp if with_dp else None, t)}}} {float(v)}")
    if extra_families:
        out += [
            "# HELP sglang:num_running_reqs The number of running requests",
            "# TYPE sglang:num_running_reqs gauge",
            f'sglang:num_running_reqs{{{_labels(0, 0)}}} 12.0',
            "# HELP sglang:num_retracted_reqs retracted",
            "# TYPE sglang:num_retracted_reqs gauge",
            f"sglang:num_retracted_reqs{{{_labels(0, 0, pid_extra)}}} 0.0",
            "# HELP sglang:num_requests_total The number of requests",
            "# TYPE sglang:num_requests_total counter",
            f'sglang:num_requests_total{{{_labels(0, 0)}}} 321.0',
            "# HELP sglang:time_to_first_token_seconds ttft",
            "# TYPE sglang:time_to_first_token_seconds histogram",
            f'sglang:time_to_first_token_seconds_bucket{{{_labels(0, 0)},le="0.1"}} 3.0',
            f'sglang:time_to_first_token_seconds_bucket{{{_labels(0, 0)},le="+Inf"}} 5.0',
            f'sglang:time_to_first_token_seconds_sum{{{_labels(0, 0)}}} 1.5',
            f'sglang:time_to_first_token_seconds_count{{{_labels(0, 0)}}} 5.0',
        ]
    return "\n".join(out) + "\n"


def test_single_pool_no_dp_label():
    cap = parse_engine_metrics(sglang_metrics([(100_000, 25_000, 0.25)], tp=1, with_dp=False))
    assert cap is not None
    assert cap.capacity == 100_000
    assert cap.used == 25_000
    assert cap.worst_usage == pytest.approx(0.25)
    assert len(cap.pools) == 1


def test_tp_duplicated_metrics_not_double_counted():
    # tp_rank 0..3 export identical copies: capacity must be 200000, not 800000; usage 0.4, not 0.1.
    text = sglang_metrics([(200_000, 80_000, 0.4)], tp=4)
    assert text.count("sglang:max_total_num_tokens{") == 4
    cap = parse_engine_metrics(text)
    assert cap.capacity == 200_000
    assert cap.used == 80_000
    assert cap.worst_usage == pytest.approx(0.4)
    assert cap.usage == pytest.approx(0.4)


def test_dp_ranks_summed_and_worst_pool_for_pressure():
    # 2 dp ranks x 4 tp ranks: capacity summed over dp only.
    text = sglang_metrics([(100_000, 30_000, 0.3), (100_000, 95_000, 0.95)], tp=4)
    cap = parse_engine_metrics(text)
    assert cap.capacity == 200_000
    assert cap.used == 125_000
    assert cap.worst_usage == pytest.approx(0.95)  # one pool under pressure
    assert cap.usage == pytest.approx(0.625)  # the mean would hide it
    assert [p.capacity for p in cap.pools] == [100_000, 100_000]


def test_usage_zero_with_used_falls_back_to_ratio():
    cap = parse_engine_metrics(sglang_metrics([(100_000, 46_000, 0.0)], tp=2))
    assert cap.worst_usage == pytest.approx(0.46)
    assert cap.pools[0] == Pool(100_000, 46_000, 0.46, requests=12)  # 12 running (the extra families)


def test_usage_zero_and_used_zero_stays_zero():
    cap = parse_engine_metrics(sglang_metrics([(100_000, 0, 0.0)]))
    assert cap.worst_usage == 0.0 and cap.used == 0


def test_missing_series_returns_none():
    assert parse_engine_metrics("") is None
    assert parse_engine_metrics("# HELP x y\n# TYPE x gauge\nx 1.0\n") is None
    assert parse_engine_metrics("not prometheus {{{") is None
    # capacity present but zero -> no usable pool
    assert parse_engine_metrics(sglang_metrics([(0, 0, 0.0)])) is None


def test_nan_values_are_ignored():
    text = sglang_metrics([(100_000, 10_000, 0.1)]).replace(
        "sglang:token_usage{" + _labels(0, 0) + "} 0.1", "sglang:token_usage{" + _labels(0, 0) + "} NaN"
    )
    cap = parse_engine_metrics(text)
    assert cap.worst_usage == pytest.approx(0.1)  # derived from used/capacity


def test_usage_only_derives_used():
    text = "\n".join(
        [
            "# TYPE sglang:max_total_num_tokens gauge",
            'sglang:max_total_num_tokens{tp_rank="0"} 50000.0',
            "# TYPE sglang:token_usage gauge",
            'sglang:token_usage{tp_rank="0"} 0.5',
        ]
    )
    cap = parse_engine_metrics(text + "\n")
    assert cap.used == 25_000 and cap.worst_usage == 0.5


def test_parse_loads_dp_ranks():
    obj = {
        "loads": [
            {"dp_rank": 0, "num_used_tokens": 1000, "max_total_num_tokens": 10_000, "token_usage": 0.1, "num_running_reqs": 3},
            {"dp_rank": 1, "num_used_tokens": 9000, "max_total_num_tokens": 10_000, "token_usage": 0.9},
        ]
    }
    cap = parse_engine_loads(obj)
    assert cap.capacity == 20_000 and cap.used == 10_000
    assert cap.worst_usage == pytest.approx(0.9)


def test_parse_loads_tolerates_missing_keys_and_fallback():
    obj = {"loads": [{"max_total_num_tokens": 10_000, "num_used_tokens": 3000}, {"token_usage": 0.5}, "junk"]}
    cap = parse_engine_loads(obj)
    assert cap.capacity == 10_000
    assert cap.worst_usage == pytest.approx(0.3)  # usage missing -> used/capacity
    obj2 = {"loads": [{"max_total_num_tokens": 8000, "num_used_tokens": 2000, "token_usage": 0}]}
    assert parse_engine_loads(obj2).worst_usage == pytest.approx(0.25)


def test_parse_loads_duplicate_rank_taken_once():
    e = {"dp_rank": 0, "num_used_tokens": 5000, "max_total_num_tokens": 10_000, "token_usage": 0.5}
    cap = parse_engine_loads({"loads": [e, dict(e), dict(e)]})
    assert cap.capacity == 10_000 and cap.used == 5000


@pytest.mark.parametrize("obj", [None, [], {}, {"loads": None}, {"loads": []}, {"loads": [{}]}, "x", {"loads": [{"max_total_num_tokens": "abc"}]}])
def test_parse_loads_bad_shapes(obj):
    assert parse_engine_loads(obj) is None


def test_cluster_snapshot_sums_engines():
    a = parse_engine_metrics(sglang_metrics([(100_000, 20_000, 0.2)], tp=4))
    b = parse_engine_metrics(sglang_metrics([(50_000, 40_000, 0.8), (50_000, 10_000, 0.2)], tp=2))
    snap = ClusterSnapshot.build({"http://a": a, "http://b": b, "http://c": None}, now=12.5)
    assert snap.taken_at == 12.5
    assert snap.capacity == 200_000
    assert snap.used == 70_000
    assert snap.worst_usage == pytest.approx(0.8)
    assert snap.mean_usage == pytest.approx(0.35)
    assert snap.healthy == frozenset({"http://a", "http://b"})
    assert snap.unhealthy == frozenset({"http://c"})
    d = snap.to_dict()
    assert d["capacity_tokens"] == 200_000 and d["healthy_engines"] == ["http://a", "http://b"]


def test_engine_capacity_from_pools():
    e = EngineCapacity.from_pools([(1000, 500, 0.0), (1000, 100, 0.1)])
    assert e.capacity == 2000 and e.used == 600 and e.worst_usage == pytest.approx(0.5)


def test_stale_after():
    assert stale_after_s(2) == 6.0
    assert stale_after_s(1) == 5.0
    assert stale_after_s(0.5) == 5.0
    assert stale_after_s(10) == 30.0
    for bad in (0, -1, math.inf, "2"):
        with pytest.raises(ValueError):
            stale_after_s(bad)


def test_running_and_waiting_requests_are_read_per_pool():
    """The compute load session placement balances: num_running_reqs + waiting (num_waiting_reqs in
    /v1/loads, num_queue_reqs in /metrics), per DP rank; 0 when an engine does not report them."""
    cap = parse_engine_loads({"loads": [
        {"dp_rank": 0, "max_total_num_tokens": 1000, "num_used_tokens": 10, "num_running_reqs": 3, "num_waiting_reqs": 4},
        {"dp_rank": 1, "max_total_num_tokens": 1000, "num_used_tokens": 10, "num_running_reqs": 1}]})
    assert [p.requests for p in cap.pools] == [7, 1]
    assert parse_engine_loads({"loads": [{"max_total_num_tokens": 1000}]}).pools[0].requests == 0
    text = sglang_metrics([(100_000, 25_000, 0.25)], tp=2, with_dp=False) + \
        "# HELP sglang:num_queue_reqs q\n# TYPE sglang:num_queue_reqs gauge\n" \
        'sglang:num_queue_reqs{engine_type="unified",model_name="m",tp_rank="0"} 5.0\n'
    assert parse_engine_metrics(text).pools[0].requests == 12 + 5
    snap = ClusterSnapshot.build({"http://e0": cap}, 1.0)
    back = ClusterSnapshot.from_wire(orjson.loads(orjson.dumps(snap.to_wire())), 1.0)
    assert [p.requests for p in back.engines["http://e0"].pools] == [7, 1]


def test_scrape_timeout_outlasts_a_busy_engine_and_stays_within_the_staleness_bound():
    from kvgate.admission.capacity import stale_after_s
    from kvgate.admission.poller import scrape_timeout_s
    # a real engine busy with a long prefill on a loaded CPU answered /v1/loads later than 0.16 s
    assert scrape_timeout_s(0.2) == scrape_timeout_s(2.0) == 2.0
    assert scrape_timeout_s(10.0) == 8.0
    for interval in (0.01, 0.2, 1.0, 2.0, 10.0, 600.0):
        assert scrape_timeout_s(interval) <= stale_after_s(interval) / 2
