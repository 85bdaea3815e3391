"""The fleet's layout (kvgate.fleet.roles) and the roles discovery reads from smg's /workers (pure)."""

from hypothesis import HealthCheck, given, settings, strategies as st

from kvgate.fleet import roles
from kvgate.fleet.discovery import Engine, parse_workers
from kvgate.fleet.health import engines_check

TYPES = st.sampled_from(["regular", "prefill", "decode", "encode", ""])


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), TYPES), max_size=12, unique_by=lambda t: t[0]))
def test_every_engine_is_a_kv_holder_or_prefill_only_and_every_one_gets_closes(spec):
    """The two sets split the fleet, in order; a close goes to all; the layout counts add up; a fleet with a
    prefill or a decode worker is PD (mixed with regular engines too), one without is regular."""
    engines = [Engine(f"http://h:{p}", t) for p, t in spec]
    holders, pre = roles.kv_holders(engines), roles.prefill_only(engines)
    assert sorted(e.url for e in holders + pre) == sorted(e.url for e in engines)
    assert not set(holders) & set(pre)
    assert all(e.worker_type == "prefill" for e in pre)
    assert roles.close_targets(engines) == [e.url for e in engines]
    lay = roles.layout(engines)
    assert len(lay.regular) + len(lay.prefill) + len(lay.decode) == len(engines)
    assert lay.prefill == tuple(e.url for e in pre)
    has_pd = any(t in ("prefill", "decode") for _, t in spec)
    assert lay.pd == has_pd
    assert lay.kind == ("empty" if not spec else "regular" if not has_pd
                        else "mixed" if any(t not in ("prefill", "decode") for _, t in spec) else "pd")
    assert lay.describe()


def test_layout_lines():
    e = [Engine("http://p:1", "prefill"), Engine("http://p:2", "prefill")] + \
        [Engine(f"http://d:{i}", "decode") for i in range(6)]
    assert roles.layout(e).describe() == "2 prefill + 6 decode workers (PD; sessions live on the decode workers)"
    assert roles.layout(e[2:]).describe().endswith("no prefill worker: nothing prefills)")
    assert roles.layout([Engine("http://r:1"), Engine("http://r:2", dp_ranks=4)]).describe() == \
        "2 regular engines, 5 DP ranks"
    assert roles.layout([]).describe() == "no engine"


def test_dp_aware_pd_workers_collapse_to_engines_with_their_ranks_and_bootstrap_port():
    """smg 1.13 --pd-disaggregation --dp-aware: one /workers entry per rank (measured shape)."""
    obj = {"workers": [
        {"url": "http://127.0.0.1:43339@1", "worker_type": "prefill", "is_healthy": True, "bootstrap_port": 50851,
         "dp_rank": 1, "dp_size": 2, "labels": {"dp_size": "2"}},
        {"url": "http://127.0.0.1:36431@0", "worker_type": "decode", "is_healthy": True, "bootstrap_port": None,
         "dp_rank": 0, "dp_size": 2, "labels": {"dp_size": "2"}},
        {"url": "http://127.0.0.1:36431@1", "worker_type": "decode", "is_healthy": False, "dp_size": 2},
        {"url": "http://127.0.0.1:43339@0", "worker_type": "prefill", "is_healthy": True, "bootstrap_port": 50851},
    ]}
    assert parse_workers(obj) == [Engine("http://127.0.0.1:43339", "prefill", True, 2, 50851),
                                  Engine("http://127.0.0.1:36431", "decode", True, 2, None)]
    # without --dp-aware the worker's dp_size label says how many ranks it has
    assert parse_workers({"workers": [{"url": "http://h:1", "worker_type": "decode",
                                       "labels": {"dp_size": "4"}}]}) == [Engine("http://h:1", "decode", True, 4)]


def test_health_is_fatal_without_a_usable_worker_of_either_role():
    roles_ = {"p": "prefill", "d1": "decode", "d2": "decode"}
    ok = engines_check([("p", True, None), ("d1", True, None), ("d2", False, "(down)")], True, None, roles=roles_)
    assert ok.ok is False and not ok.fatal  # one decode worker of two down: degraded
    no_pre = engines_check([("p", False, "(down)"), ("d1", True, None), ("d2", True, None)], True, None,
                           roles=roles_)
    assert no_pre.ok is False and no_pre.fatal and "no prefill worker is usable" in no_pre.reason
    no_dec = engines_check([("p", True, None), ("d1", False, "(x)"), ("d2", False, "(x)")], True, None,
                           roles=roles_)
    assert no_dec.fatal and "no decode worker is usable" in no_dec.reason


def test_a_decode_worker_without_its_radix_cache_is_warned_about():
    from kvgate.fleet import compat
    base = {"enable_session_radix_cache": True, "version": "0.5.23"}
    kinds = lambda info: [k for k, _ in compat.engine_warnings({**base, **info}, 200)]  # noqa: E731
    assert kinds({"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": False}) == \
        ["decode_radix_cache_off"]
    assert kinds({"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True}) == []
    assert kinds({"disaggregation_mode": "prefill", "disaggregation_decode_enable_radix_cache": False}) == []
    assert kinds({"disaggregation_mode": "null"}) == []
