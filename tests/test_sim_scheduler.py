"""Pure scheduler (kvgate.sim.scheduler): PrefillAdder admission, chunked prefill, decode
retraction victim order, OOM abort, new_token_ratio, determinism. Driven with a fake clock."""

import pytest

from kvgate.sim.radix import RadixCache
from kvgate.sim.scheduler import (OOM_MESSAGE, Request, Scheduler, SchedulerConfig,
                                  TokenModel)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


def make(max_total=1000, **cfg):
    clock = FakeClock()
    return Scheduler(RadixCache(max_total), SchedulerConfig(**cfg), clock=clock), clock


def ids(start, n):
    return tuple(range(start, start + n))


def finished(sched):
    return {e.req.rid: e.req for e in sched.pop_events() if e.finished}


def test_waiting_request_held_until_budget_allows():
    s, clock = make(1000, new_token_ratio_semantics="0.5.23")
    s.add_request(Request("A", ids(1000, 100), max_new_tokens=500, ignore_eos=True))
    b = s.step()
    assert b.kind == "prefill" and [r.rid for r, _ in b.items] == ["A"]
    s.add_request(Request("B", ids(5000, 300), max_new_tokens=200, ignore_eos=True))
    # budget = available 900 + evictable 0 - A's 499 remaining (0.5.23: ratio 1.0 with ignore_eos)
    assert s.admission_budget() == 401
    steps = 0
    while "A" in s.requests:
        b = s.step()
        assert b.kind == "decode" and [r.rid for r, _ in b.items] == ["A"]
        assert [r.rid for r in s.waiting] == ["B"]
        steps += 1
    assert steps == 499
    # A finished: its 599 KV tokens are cached (evictable), so B now fits: 1000 >= 300 + 200
    assert (s.cache.available, s.cache.evictable) == (401, 599)
    b = s.step()
    assert b.kind == "prefill" and b.items[0][0].rid == "B" and b.items[0][1] == 300


def test_new_token_ratio_discounts_reservation_without_ignore_eos():
    s, _ = make(1000)
    s.add_request(Request("A", ids(1000, 100), max_new_tokens=500))
    s.step()
    assert s.new_token_ratio == pytest.approx(0.7)
    assert s.admission_budget() == pytest.approx(900 - 499 * 0.7)
    s.add_request(Request("B", ids(5000, 300), max_new_tokens=200))
    b = s.step()
    assert b.kind == "prefill" and b.items[0][0].rid == "B"


def test_new_token_ratio_decays_to_floor():
    s, _ = make(100000)
    s.add_request(Request("A", ids(1, 10), max_new_tokens=2000, ignore_eos=True))
    s.step()
    for _ in range(10):
        s.step()
    assert s.new_token_ratio == pytest.approx(0.7 - 10 * (0.7 - 0.098) / 600)
    for _ in range(700):
        s.step()
    assert s.new_token_ratio == pytest.approx(0.098)


def test_chunked_prefill_splits_long_prompt():
    s, _ = make(10000, chunked_prefill_size=32)
    s.add_request(Request("L", ids(1, 100), max_new_tokens=3, ignore_eos=True))
    kinds = []
    while (b := s.step()) is not None:
        kinds.append((b.kind, [t for _, t in b.items]))
    assert kinds == [("prefill", [32]), ("prefill", [32]), ("prefill", [32]),
                     ("prefill", [4]), ("decode", [1]), ("decode", [1])]


def test_max_running_requests_bound():
    s, _ = make(10000, max_running_requests=2)
    for i in range(3):
        s.add_request(Request(f"r{i}", ids(100 * i + 1, 10), max_new_tokens=5, ignore_eos=True))
    b = s.step()
    assert [r.rid for r, _ in b.items] == ["r0", "r1"]
    assert [r.rid for r in s.waiting] == ["r2"]


def test_prefix_cache_hits_count_cached_tokens():
    s, _ = make(10000)
    p = ids(1, 50)
    s.add_request(Request("a", p + (7, 7), max_new_tokens=4, ignore_eos=True))
    s.run_until_idle()
    s.add_request(Request("b", p + (8, 8, 8), max_new_tokens=4, ignore_eos=True))
    s.add_request(Request("c", p + (7, 7), max_new_tokens=4, ignore_eos=True))
    s.run_until_idle()
    done = finished(s)
    assert done["a"].cached_tokens == 0
    assert done["b"].cached_tokens == 50
    assert done["c"].cached_tokens == 51   # whole prompt minus the last token (max_prefix_len)
    assert s.cached_tokens_total == 101 and s.prompt_tokens_total == 52 + 53 + 52


def test_retraction_victim_order_and_sole_request_abort():
    s, _ = make(1000)
    s.add_request(Request("R1", ids(1000, 40), max_new_tokens=50, ignore_eos=True))
    s.add_request(Request("R2", ids(2000, 30), max_new_tokens=50, ignore_eos=True))
    s.add_request(Request("R3", ids(3000, 50), max_new_tokens=50, ignore_eos=True))
    assert s.step().kind == "prefill"
    for _ in range(4):
        s.step()
    assert [len(r.output_ids) for r in s.running] == [5, 5, 5]
    # exhaust the pool from outside: the next decode step cannot get 3 tokens
    s.cache.alloc(s.cache.available)
    b = s.schedule()   # equal outputs -> longest input (R3, 50) is retracted first
    assert [r.rid for r, _ in b.items] == ["R1", "R2"]
    assert [r.rid for r in s.waiting] == ["R3"]
    assert s.retracted_total == 1 and s.last_retracted == 1
    r3 = s.waiting[0]
    assert r3.num_retractions == 1 and r3.kv_len == 0 and len(r3.output_ids) == 5
    # ratio reset: (decoded 10 + 20 * 2) / max_new 100
    assert s.new_token_ratio == pytest.approx(0.5)
    s.commit(b)
    s.cache.alloc(s.cache.available)
    b = s.schedule()   # R1 (40) before R2 (30)
    assert [r.rid for r, _ in b.items] == ["R2"]
    # retracted requests go to the BACK of the waiting queue (scheduler.py _add_request_to_queue)
    assert [r.rid for r in s.waiting] == ["R3", "R1"]
    assert s.retracted_total == 2
    s.commit(b)
    s.cache.alloc(s.cache.available)
    b = s.schedule()   # R2 alone cannot fit -> aborted
    assert b is None
    done = finished(s)
    assert done["R2"].finish_reason == {"type": "abort", "message": OOM_MESSAGE,
                                        "status_code": 500}
    assert s.aborted_total == 1 and len(done["R2"].output_ids) == 7
    # release the hog: R1 and R3 recompute and finish with the reference outputs
    s.cache.free(s.cache.private)
    s.run_until_idle()
    done = finished(s)
    model = TokenModel()
    for rid, p in (("R1", ids(1000, 40)), ("R3", ids(3000, 50))):
        assert done[rid].output_ids == model.generate(p, 50)
        assert done[rid].finish_reason == {"type": "length", "length": 50}
    assert s.cache.num_used == 0
    s.cache.check_invariants()


def test_natural_retraction_under_pressure():
    # three prompts admitted with new_token_ratio < 1 overcommit a 400-token pool; R3 arrives after the
    # first prefill round (in the same round it would find no tokens and latch batch_is_full)
    s, _ = make(400)
    for rid, start, n in (("R1", 1000, 40), ("R2", 2000, 30)):
        s.add_request(Request(rid, ids(start, n), max_new_tokens=100))
    assert s.step().kind == "prefill"
    s.add_request(Request("R3", ids(3000, 50), max_new_tokens=100))
    s.run_until_idle()
    done = finished(s)
    assert s.retracted_total == 1
    assert done["R3"].num_retractions == 1          # fewest outputs: admitted last
    assert done["R1"].num_retractions == done["R2"].num_retractions == 0
    model = TokenModel()
    for rid, start, n in (("R1", 1000, 40), ("R2", 2000, 30), ("R3", 3000, 50)):
        assert done[rid].output_ids == model.generate(ids(start, n), 100)
    assert s.cache.num_used == 0 and s.aborted_total == 0


def test_prompt_plus_max_new_over_the_pool_is_clipped_on_arrival():
    """scheduler.py init_req_max_new_tokens + allocator/base.py max_new_tokens_for_memory: max_new is
    clipped to max_total - prompt - 2 when the request arrives, so it ends with "length" (no OOM abort)."""
    s, _ = make(100)
    big = Request("big", ids(1, 90), max_new_tokens=50, ignore_eos=True)
    s.add_request(big)
    assert big.max_new_tokens == 8 and s.clipped_total == 1
    s.run_until_idle()
    done = finished(s)
    assert done["big"].finish_reason == {"type": "length", "length": 8}
    assert s.aborted_total == 0
    # 90 prompt + 7 decoded tokens' KV cached (the last token's KV is never written)
    assert (s.cache.available, s.cache.evictable) == (3, 97)


def test_outputs_identical_with_and_without_caching_and_pressure():
    model = TokenModel(eos_rate=0.02)
    prompts = [ids(1, 60) + ids(500 + 10 * i, 8) for i in range(12)]
    ref = [model.generate(p, 40, ignore_eos=False) for p in prompts]
    for max_total, chunk in ((100000, 8192), (300, 8192), (220, 16)):
        s, _ = make(max_total, eos_rate=0.02, chunked_prefill_size=chunk)
        for i, p in enumerate(prompts):
            s.add_request(Request(f"q{i}", p, max_new_tokens=40))
        s.run_until_idle()
        done = finished(s)
        assert [done[f"q{i}"].output_ids for i in range(12)] == ref, max_total
        for i in range(12):
            fr = done[f"q{i}"].finish_reason
            if len(ref[i]) < 40:
                assert fr == {"type": "stop", "matched": 2}
            else:
                assert fr == {"type": "length", "length": 40}
        s.cache.check_invariants()


def test_abort_running_request_caches_its_kv():
    s, _ = make(1000)
    s.add_request(Request("x", ids(1, 20), max_new_tokens=100, ignore_eos=True))
    for _ in range(5):
        s.step()
    assert s.cache.num_used == 24
    assert s.abort("x")
    done = finished(s)
    assert done["x"].finish_reason["type"] == "abort"
    assert s.cache.num_used == 0 and s.cache.evictable == 24 and s.aborted_total == 1


def test_compute_time_model():
    s, _ = make(100000, speed=10.0)
    s.add_request(Request("a", ids(1, 2000), max_new_tokens=3, ignore_eos=True))
    b = s.step()
    assert b.duration_s == pytest.approx(2000 / 20000 / 10)
    b = s.step()   # one seq, context 2001 tokens
    assert b.duration_s == pytest.approx((6.0e-3 + 0.03e-3 + 0.05e-6 * 2001) / 10)
