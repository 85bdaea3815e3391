"""`kvgate bench` on real engines, the pure parts: the scenario's engine keys, the run order that keeps engines,
the engines' counters read from /metrics, the compute fit and the CPU engine's prefill rule in the simulator."""

import json

import pytest

from kvgate.bench.sglang_fleet import parse_counters, totals_delta
from kvgate.bench.runner import ArmSpec, expand_arms, turn_body
from kvgate.bench.scenario import load_scenario, parse_scenario
from kvgate.bench.command import run_order
from kvgate.sim.fit import fit_decode, fit_prefill
from kvgate.sim.radix import RadixCache
from kvgate.sim.scheduler import Request, Scheduler, SchedulerConfig

AGENTIC = {"kind": "agentic", "groups": 1, "group_size": 1}


def test_engine_sglang_needs_speed_1_and_refuses_hicache_arms():
    base = {"arms": ["direct"], "workload": AGENTIC, "engine": "sglang"}
    assert parse_scenario(dict(base)).engine == "sglang"
    with pytest.raises(ValueError, match="^speed: must be 1 with engine: sglang"):
        parse_scenario({**base, "speed": 4})
    with pytest.raises(ValueError, match=r"^arms: \['hicache'\] need HiCache engines"):
        parse_scenario({**base, "arms": ["direct", "hicache"]})
    with pytest.raises(ValueError, match="^engine: must be one of sim, sglang"):
        parse_scenario({**base, "engine": "vllm"})
    with pytest.raises(ValueError, match="^ignore_eos: must be true or false"):
        parse_scenario({**base, "ignore_eos": "no"})


def test_the_real_engine_scenario_parses_for_both_engines():
    sc = load_scenario("configs/bench/real-programs.yaml")
    assert (sc.engine, sc.speed, sc.ignore_eos, sc.engines) == ("sglang", 1, False, 2)
    names = [a.name for a in expand_arms(sc)]
    assert names == ["direct", "direct-overload-off", "lifecycle", "lifecycle+admission-program", "unbounded-kv"]
    off = expand_arms(sc)[1]
    assert off.router_flags == ("--disable-worker-overload-protection",)


def test_run_order_starts_real_engines_once_per_pool_size():
    arms = [ArmSpec("direct", pool_tokens=9000), ArmSpec("unbounded-kv", pool_tokens=60000),
            ArmSpec("lifecycle", pool_tokens=9000)]
    order = [(i, a.name) for i, a in run_order(arms, [1, 2, 3], real=True)]
    assert order == [(0, "direct"), (0, "lifecycle"), (1, "direct"), (1, "lifecycle"), (2, "direct"),
                     (2, "lifecycle"), (0, "unbounded-kv"), (1, "unbounded-kv"), (2, "unbounded-kv")]
    # the simulator starts a fleet per arm anyway: replicate-major in the scenario's order
    assert [(i, a.name) for i, a in run_order(arms, [1, 2], real=False)][:3] == [
        (0, "direct"), (0, "unbounded-kv"), (0, "lifecycle")]


def test_turns_without_ignore_eos_fix_the_length_with_min_new_tokens():
    body = json.loads(turn_body("generate", [5, 6, 7], 48, "s-turn1", ignore_eos=False))
    assert body["input_ids"] == [5, 6, 7]
    assert body["sampling_params"] == {"max_new_tokens": 48, "min_new_tokens": 48}
    body = json.loads(turn_body("generate", "ab", 8, None))
    assert body["sampling_params"] == {"max_new_tokens": 8, "ignore_eos": True}


METRICS = """# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{engine_type="unified",model_name="m",tp_rank="0"} 1200.0
sglang:cached_tokens_total{engine_type="unified",model_name="m",tp_rank="0"} 700.0
sglang:evicted_tokens_total{cache_type="device",model_name="m"} 300.0
sglang:evicted_tokens_total{cache_type="host",model_name="m"} 5.0
sglang:num_retracted_requests_total{model_name="m"} 2.0
sglang:token_usage{model_name="m"} 0.5
"""


def test_engine_counters_from_metrics_sum_label_sets_and_absent_ones_are_zero():
    c = parse_counters(METRICS)
    assert c["prompt_tokens"] == 1200 and c["cached_tokens"] == 700
    assert c["evicted_tokens"] == 305 and c["retractions"] == 2 and c["aborted"] == 0
    later = dict(c, prompt_tokens=2000.0, retractions=3.0)
    d = totals_delta([c, c], [later, c])
    assert d["prompt_tokens"] == 800 and d["retractions"] == 1 and d["cached_tokens"] == 0


def test_fits_recover_known_constants():
    # prefill: 20 ms + extend / 2000 tok/s + 1e-8 s x (prefix + extend)^2 / 2
    pre = [(p, e, 0.02 + e / 2000 + 1e-8 * (p + e) ** 2 / 2) for p in (0, 256, 1024) for e in (32, 256, 1024)]
    f = fit_prefill(pre)
    assert f["base_ms"] == pytest.approx(20) and f["tokens_per_s"] == pytest.approx(2000)
    assert f["attn_s_per_ctx_token2"] == pytest.approx(1e-8) and f["r2"] == pytest.approx(1)
    dec = [(b, b * c, 0.01 + 0.002 * b + 1e-7 * b * c) for b in (1, 4, 16) for c in (200, 1000)]
    d = fit_decode(dec)
    assert (d["base_ms"], d["per_seq_ms"], d["per_ctx_token_us"]) == pytest.approx((10, 2, 0.1))
    with pytest.raises(ValueError, match="singular"):
        fit_prefill([(0, 10, 1.0)] * 3)


def test_cpu_prefill_pays_attention_over_the_cached_prefix_too():
    """torch_native_backend.py _run_sdpa_forward_extend: the query is padded to the whole context, so a cached
    prefix saves its tokens' weights but not its attention."""
    kw = dict(prefill_tokens_per_s=1000.0, prefill_attn_flops_per_ctx_token=1.0, prefill_weight_flops_per_token=1000.0,
              prefill_base_ms=10.0)
    gpu = Scheduler(RadixCache(10_000), SchedulerConfig(**kw))
    cpu = Scheduler(RadixCache(10_000), SchedulerConfig(prefill_attention_whole_context=True, **kw))
    r = Request("x", (), 1)
    r.kv_len = 1100  # 1,000 cached + 100 extended
    # 100 / 1000 + attention pairs / (1000 x 1000) + 10 ms
    assert gpu.prefill_time_s([(r, 100)]) == pytest.approx(0.1 + 100 * (1000 + 50) / 1e6 + 0.01)
    assert cpu.prefill_time_s([(r, 100)]) == pytest.approx(0.1 + 1100 ** 2 / 2 / 1e6 + 0.01)


def test_compute_scale_stretches_prefill_and_decode_alike():
    kw = dict(prefill_tokens_per_s=1000.0, prefill_base_ms=10.0, decode_base_ms=40.0, decode_per_seq_ms=0.0,
              decode_per_ctx_token_us=0.0)
    one = Scheduler(RadixCache(10_000), SchedulerConfig(**kw))
    two = Scheduler(RadixCache(10_000), SchedulerConfig(compute_scale=2.0, **kw))
    r = Request("x", (), 1)
    r.kv_len = 100
    assert two.prefill_time_s([(r, 100)]) == pytest.approx(2 * one.prefill_time_s([(r, 100)])) == pytest.approx(0.22)
