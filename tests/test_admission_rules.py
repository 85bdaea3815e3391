"""The ledger's rules on the small inputs where the old ledger went wrong, each with its exact numbers:
shared prefixes, per-engine ceilings, bypasses that reserve, the OpenAI routes' budget, backfill, huge n,
implausible capacity figures. Hand-driven clock, no I/O."""

import orjson

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity, parse_engine_loads, parse_engine_metrics
from kvgate.admission.coordinator import AdmissionCoordinator, Kind
from kvgate.admission.ledger import Ledger
from kvgate.admission.reservation import estimate_request

CAP = 4096


def snap(now, engines):
    return ClusterSnapshot.build({u: EngineCapacity.from_pools([(c, 0, 0.0)]) for u, c in engines.items()}, now)


def make(engines, backfill=False, max_wait_s=30.0):
    lg = Ledger(headroom=0.9, pressure_threshold=0.92, stale_after_s=1e6, lease_ttl_s=1e6)
    co = AdmissionCoordinator(lg, max_wait_s=max_wait_s, backfill=backfill)
    co.reconcile(snap(0.0, engines), 0.0)
    return co, lg


def gen(prompt_ids, max_new):
    return estimate_request("/generate", {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": max_new}},
                            expected_decode_cap=CAP)


def test_grpo_siblings_over_a_warm_prompt_reserve_the_prompt_once():
    # 8 siblings over one 8,000-token task prompt, 500 new tokens each, one 40,000-token engine (ceiling 36,000)
    co, lg = make({"http://e0": 40_000})
    task = list(range(8000))
    rs = [gen(task, 500) for _ in range(8)]
    assert rs[0].tokens == 8500 and len(rs[0].blocks) * rs[0].block_tokens == 8000
    ds = [co.submit(i, r.tokens, False, 1.0, blocks=r.blocks) for i, r in enumerate(rs)]
    assert [d.kind for d in ds] == [Kind.ADMIT] * 8  # all eight at once, none waits
    assert lg.reserved == 8000 + 8 * 500 == 12_000
    assert [d.lease.charged for d in ds] == [8500] + [500] * 7
    for i in range(8):
        co.release(i, 2.0)
    assert lg.reserved == 0
    # the old rule (whole prompt per request) would have held four of them: 4 x 8,500 = 34,000 <= 36,000 < 5 x
    co2, lg2 = make({"http://e0": 40_000})
    kinds = [co2.submit(i, r.tokens, False, 1.0).kind for i, r in enumerate(rs)]
    assert kinds.count(Kind.ADMIT) == 4 and kinds.count(Kind.WAIT) == 4


def test_different_prompts_do_not_share():
    co, lg = make({"http://e0": 40_000})
    a, b = gen(list(range(8000)), 500), gen(list(range(1, 8001)), 500)
    co.submit("a", a.tokens, False, 0.0, blocks=a.blocks)
    co.submit("b", b.tokens, False, 0.0, blocks=b.blocks)
    assert lg.reserved == 17_000


def test_the_busy_engines_own_ceiling_binds():
    # two 10,000-token engines (fleet ceiling 18,000); everything placed on e0 (ceiling 9,000)
    co, lg = make({"http://e0": 10_000, "http://e1": 10_000})
    assert co.submit("a", 6600, False, 0.0, place="http://e0").kind is Kind.ADMIT
    w = co.submit("b", 6600, False, 1.0, place="http://e0")
    assert w.kind is Kind.WAIT and w.reason == "capacity_exhausted"  # fleet-wide it would have fit: 13,200 <= 18,000
    assert lg.reserved_on("http://e0") == 6600 and lg.ceiling_of("http://e0") == 9000 and lg.ceiling == 18_000
    out = co.release("a", 4.0)
    assert [(d.ticket, d.kind, d.waited_s) for d in out] == [("b", Kind.ADMIT, 3.0)]


def test_unknown_engine_falls_back_to_the_fleet_rule():
    co, lg = make({"http://e0": 10_000, "http://e1": 10_000})
    assert co.submit("a", 6600, False, 0.0, place="http://e0").kind is Kind.ADMIT
    assert co.submit("b", 6600, False, 0.0, place=None).kind is Kind.ADMIT  # 13,200 <= 18,000
    assert co.submit("c", 6600, False, 0.0, place="http://gone:1").kind is Kind.WAIT  # not in the snapshot: fleet
    assert lg.resolve_place("http://gone:1") is None


def test_dp_rank_pool_ceiling():
    lg = Ledger(headroom=0.9, stale_after_s=1e6)
    lg.reconcile(ClusterSnapshot.build({"http://e0": EngineCapacity.from_pools([(10_000, 0, 0.0), (10_000, 0, 0.0)])},
                                       0.0), 0.0)
    assert lg.ceiling_of(("http://e0", 1)) == 9000 and lg.ceiling_of("http://e0") == 18_000
    assert lg.try_acquire("a", 6600, 0.0, place=("http://e0", 1))
    assert not lg.try_acquire("b", 6600, 0.0, place=("http://e0", 1))
    assert lg.try_acquire("c", 6600, 0.0, place=("http://e0", 0))


def test_a_bypass_still_reserves_so_training_work_waits_in_kvgate():
    # a protected 6,600-token request runs on a 10,000-token engine (ceiling 9,000); a 6,600 training one arrives
    co, lg = make({"http://e0": 10_000})
    p = co.submit("protected", 6600, True, 0.0)
    assert p.kind is Kind.BYPASS_PROTECTED and p.lease is not None and lg.reserved == 6600
    t = co.submit("train", 6600, False, 1.0)
    assert t.kind is Kind.WAIT and t.reason == "capacity_exhausted"
    # a second protected request never waits, even over the ceiling
    assert co.submit("protected2", 6600, True, 1.5).kind is Kind.BYPASS_PROTECTED and lg.reserved == 13_200
    co.release("protected2", 2.0)
    out = co.release("protected", 3.0)
    assert [(d.ticket, d.kind, d.waited_s) for d in out] == [("train", Kind.ADMIT, 2.0)]
    co.release("train", 4.0)
    assert lg.reserved == 0


def test_an_aged_bypass_reserves_and_is_released():
    co, lg = make({"http://e0": 10_000}, max_wait_s=5.0)
    co.submit("a", 9000, False, 0.0)
    co.submit("b", 3000, False, 0.0)
    out = co.pump(5.0)
    assert [(d.ticket, d.kind) for d in out] == [("b", Kind.BYPASS_AGED)] and out[0].lease.tokens == 3000
    assert lg.reserved == 12_000
    assert co.submit("c", 10, False, 5.0).kind is Kind.WAIT
    co.release("b", 6.0)
    co.release("a", 6.0)
    assert lg.reserved == 10 and lg.lease("c") is not None


def test_chat_without_max_tokens_reserves_to_the_decode_cap():
    # a 1,000-character chat at 1 char/token: 1,000 + 8 template tokens = 1,008 prompt, + min(ctx - 1,008, 4,096)
    body = {"messages": [{"role": "user", "content": "x" * 1000}]}
    r = estimate_request("/v1/chat/completions", body, expected_decode_cap=4096, chars_per_token=1.0)
    assert (r.prompt_tokens, r.tokens) == (1008, 1008 + 4096) == (1008, 5104)
    r = estimate_request("/v1/chat/completions", body, expected_decode_cap=4096, chars_per_token=1.0,
                         context_length=32_768)
    assert r.tokens == 5104
    r = estimate_request("/v1/chat/completions", body, expected_decode_cap=4096, chars_per_token=1.0,
                         context_length=2048)
    assert r.tokens == 2048  # runs to the context length at most
    r = estimate_request("/v1/completions", {"prompt": "x" * 1000}, expected_decode_cap=4096, chars_per_token=1.0)
    assert r.tokens == 1000 + 4096
    # /generate keeps SGLang's default of 128 new tokens
    r = estimate_request("/generate", {"text": "x" * 1000}, expected_decode_cap=4096, chars_per_token=1.0)
    assert r.tokens == 1000 + 128


def _backfill_scenario(backfill):
    """Ceiling 9,000; 6,600 running; a 5,100-token head waiting; four 500-token requests arrive with 2,400
    free; the 6,600 ends 3.5 s later. Returns {ticket: waited seconds}, the order they were admitted."""
    co, lg = make({"http://e0": 10_000}, backfill=backfill)
    co.submit("running", 6600, False, 0.0)
    waited, order = {}, []

    def took(ds):
        for d in ds:
            assert d.kind is Kind.ADMIT
            waited[d.ticket] = d.waited_s
            order.append(d.ticket)

    assert co.submit("head", 5100, False, 0.0).kind is Kind.WAIT
    for i in range(4):
        d = co.submit(f"small{i}", 500, False, 0.0)
        took([d] if d.kind is Kind.ADMIT else [])
        took(co.pump(0.0))
    took(co.release("running", 3.5))
    assert lg.reserved == 5100 + 4 * 500
    return waited, order


def test_backfill_lets_small_work_pass_a_head_that_does_not_fit():
    strict, strict_order = _backfill_scenario(False)
    assert strict == {"head": 3.5, "small0": 3.5, "small1": 3.5, "small2": 3.5, "small3": 3.5}
    assert strict_order[0] == "head"
    bf, bf_order = _backfill_scenario(True)
    assert bf == {"small0": 0.0, "small1": 0.0, "small2": 0.0, "small3": 0.0, "head": 3.5}  # the head loses nothing
    assert bf_order[-1] == "head"
    # measured: total wait of the five requests 17.5 s strict -> 3.5 s with backfill
    assert sum(strict.values()) == 17.5 and sum(bf.values()) == 3.5


def test_backfill_cannot_starve_the_head():
    co, lg = make({"http://e0": 10_000}, backfill=True)
    co.submit("running", 6600, False, 0.0)
    co.submit("head", 5100, False, 0.0)
    t = 0.0
    # a steady stream of small requests: each one ends, another arrives; none may take the head's room
    for i in range(40):
        t += 0.1
        d = co.submit(i, 500, False, t)
        if d.kind is Kind.ADMIT:
            co.release(i, t + 0.05)
    admitted_small = [i for i in range(40) if lg.lease(i) is not None]
    assert admitted_small == []  # each released again
    out = co.release("running", t + 1.0)
    assert [d.ticket for d in out][:1] == ["head"]  # the head goes the moment the older lease ends
    # the bound itself: room passed to later work + the head never exceeds the ceiling
    co2, lg2 = make({"http://e0": 10_000}, backfill=True)
    co2.submit("running", 4000, False, 0.0)
    co2.submit("head", 5100, False, 0.0)  # 4,000 + 5,100 = 9,100 > 9,000: waits
    kinds = [co2.submit(i, 1000, False, 0.0).kind for i in range(5)]
    # passed + 1,000 + 5,100 <= 9,000 admits three; the fourth would leave the head too little room
    # (the ledger alone would have taken it: 4,000 + 4 x 1,000 = 8,000 <= 9,000)
    assert kinds == [Kind.ADMIT] * 3 + [Kind.WAIT] * 2
    out = co2.release("running", 1.0)
    assert [d.ticket for d in out][0] == "head" and lg2.reserved == 3000 + 5100


def test_huge_n_is_clamped_to_what_an_engine_can_hold():
    # n = 1e9 used to reserve ~7e9 tokens: every later request waited the full max_wait
    r = estimate_request("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 5, "n": 1e9}},
                         expected_decode_cap=CAP)
    assert r.tokens >= 5 * 10 ** 9
    co, lg = make({"http://e0": 10_000, "http://e1": 10_000})  # fleet ceiling 18,000
    d = co.submit("huge", r.tokens, False, 0.0)
    assert d.kind is Kind.ADMIT and d.lease.tokens == 10_000 and lg.reserved == 10_000
    assert co.submit("next", 500, False, 0.0).kind is Kind.ADMIT
    orjson.dumps(co.stats(0.0))


def test_implausible_capacity_figures_are_no_signal():
    # max_total_num_tokens 1e29 used to make /kvgate/stats answer 500; token_usage 1e300 made every request wait
    assert parse_engine_loads({"loads": [{"max_total_num_tokens": 1e29, "num_used_tokens": 0, "token_usage": 0}]}) is None
    assert parse_engine_loads({"loads": [{"max_total_num_tokens": 10_000, "token_usage": 1e300}]}) is None
    assert parse_engine_loads({"loads": [{"max_total_num_tokens": 10_000, "num_used_tokens": 1e20}]}) is None
    text = "sglang:max_total_num_tokens 1e29\nsglang:token_usage 0.1\n"
    assert parse_engine_metrics(text) is None
    ok = parse_engine_loads({"loads": [{"max_total_num_tokens": 10_000, "num_used_tokens": 1000, "token_usage": 0.1}]})
    assert ok is not None and ok.capacity == 10_000
    # an engine built from raw pools is checked too; the ledger then has no signal and every request bypasses
    bad = EngineCapacity.from_pools([(10_000, 0, 1e300)])
    lg = Ledger(stale_after_s=1e6)
    co = AdmissionCoordinator(lg, 30.0)
    co.reconcile(ClusterSnapshot.build({"http://e0": bad}, 0.0), 0.0)
    assert co.submit("a", 100, False, 0.0).kind is Kind.BYPASS_DEGRADED
    huge = EngineCapacity.from_pools([(10 ** 29, 0, 0.0)])
    co.reconcile(ClusterSnapshot.build({"http://e0": huge, "http://e1": EngineCapacity.from_pools([(10_000, 0, 0.0)])},
                                       1.0), 1.0)
    assert lg.ceiling == 9000 and lg.snapshot.unhealthy == frozenset({"http://e0"})
    orjson.dumps(co.stats(1.0))  # int64-safe figures
