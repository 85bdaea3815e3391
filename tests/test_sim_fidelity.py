"""The simulated engine's core follows SGLang where kvgate's results depend on it (pure, fake clock).

Each test names the SGLang 0.5.17 / 0.5.23 source it checks (python/sglang/srt/...)."""

import pytest

from kvgate.sim.radix import RadixCache
from kvgate.sim.scheduler import (PROFILE_CONTEXT, RETRACT_DECODE_STEPS, Request, Scheduler, SchedulerConfig,
                                  TokenModel)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(max_total=1000, session_mode="0.5.17", policy="lru", **cfg):
    return Scheduler(RadixCache(max_total, session_mode, policy), SchedulerConfig(**cfg), clock=FakeClock())


def ids(start, n):
    return tuple(range(start, start + n))


def finished(sched):
    return {e.req.rid: e.req for e in sched.pop_events() if e.finished}


def run_decodes(s, n):
    for _ in range(n):
        b = s.step()
        assert b.kind == "decode"


# ---------------------------------------------------------------- retraction (schedule_batch.py retract_decode)
def test_retraction_frees_only_output_tokens_and_the_prompt_stays_cached():
    """release_req -> release_kv_cache frees [cache_protected_len, kv_len): the prompt was inserted at prefill
    end (maybe_cache_unfinished_req), so only the output KV is freed; the prompt becomes evictable."""
    s = make(1000)
    s.add_request(Request("A", ids(1000, 300), max_new_tokens=100, ignore_eos=True))
    s.add_request(Request("B", ids(5000, 200), max_new_tokens=100, ignore_eos=True))
    assert s.step().kind == "prefill"
    # both prompts are in the tree right after the prefill, locked by their requests
    assert (s.cache.tree_tokens, s.cache.private, s.cache.evictable) == (500, 0, 0)
    run_decodes(s, 30)
    assert [len(r.output_ids) for r in s.running] == [31, 31]
    s.cache.alloc(s.cache.available)           # a hog takes every free slot
    b = s.schedule()                           # equal outputs: the longest input (A) is retracted
    assert [r.rid for r, _ in b.items] == ["B"]
    a = s.waiting[0]
    assert a.rid == "A" and a.kv_len == 0 and a.num_retractions == 1
    # A's 30 decoded tokens' KV freed (>= 20 x 1 remaining request, so no eviction); B's decode took 1
    assert s.cache.cached_len(ids(1000, 300)) == 300
    assert (s.cache.evictable, s.cache.available, s.cache.evicted_total) == (300, 29, 0)
    s.commit(b)
    # once the hog leaves, A re-prefills only its outputs: the 299-token prefix match hits the cache
    s.cache.free(s.cache.private - sum(r.private for r in s.running))
    s.run_until_idle()
    done = finished(s)
    assert done["A"].cached_tokens == 300 and done["A"].num_retractions == 1
    assert done["A"].output_ids == TokenModel().generate(ids(1000, 300), 100)


def test_retraction_evicts_until_twenty_slots_per_remaining_request():
    """release_req: evict_from_tree_cache(remaining x SGLANG_RETRACT_DECODE_STEPS): with fewer than 20 free
    slots per remaining request after freeing the outputs, the cache evicts (here A's own prompt, the only
    evictable entry: whole leaves go)."""
    s = make(1000)
    s.add_request(Request("A", ids(1000, 300), max_new_tokens=100, ignore_eos=True))
    s.add_request(Request("B", ids(5000, 200), max_new_tokens=100, ignore_eos=True))
    s.step()
    run_decodes(s, 9)                          # 9 output tokens' KV each
    s.cache.alloc(s.cache.available)
    s.schedule()
    assert RETRACT_DECODE_STEPS == 20
    # freed 9 < 20 x 1: evict A's unlocked 300-token prompt
    assert s.cache.evicted_total == 300 and s.cache.cached_len(ids(1000, 300)) == 0
    assert s.cache.available == 9 + 300 - 1


def test_retracted_requests_go_to_the_back_of_the_waiting_queue():
    """scheduler.py update_running_batch: retracted requests are re-added with _add_request_to_queue (append)."""
    s = make(1000, max_running_requests=2)
    s.add_request(Request("A", ids(1000, 100), max_new_tokens=50, ignore_eos=True))
    s.add_request(Request("B", ids(2000, 50), max_new_tokens=50, ignore_eos=True))
    s.add_request(Request("W", ids(3000, 10), max_new_tokens=5, ignore_eos=True))
    s.step()
    run_decodes(s, 25)
    assert [r.rid for r in s.waiting] == ["W"]
    s.cache.alloc(s.cache.available)
    s.schedule()                               # A (longer input) retracted: behind W
    assert [r.rid for r in s.waiting] == ["W", "A"]


# ---------------------------------------------------------------- sessions (session_ref_tracker.py, 0.5.17+)
def test_closed_session_id_reopens_on_a_new_request_and_is_tagged_again():
    s = make(1000)
    s.add_request(Request("t1", ids(100, 50), max_new_tokens=5, ignore_eos=True, session_id="S"))
    s.run_until_idle()
    assert s.cache.session_states() == {"S": {"ref_tokens": 54, "closed": False}}
    s.cache.close_session("S")
    assert s.cache.session_states() == {"S": {"ref_tokens": 0, "closed": True}}
    # a NEW request with the closed id: ensure_session_generation -> open_radix_session (tombstone cleared)
    s.add_request(Request("t2", ids(100, 60), max_new_tokens=5, ignore_eos=True, session_id="S"))
    assert "S" not in s.cache.closed
    s.run_until_idle()
    assert s.cache.session_states() == {"S": {"ref_tokens": 64, "closed": False}}


def test_a_request_admitted_before_the_close_does_not_tag_after_it():
    """register_session_ref skips a request whose session_generation is stale (closed, or re-opened since)."""
    s = make(1000)
    s.add_request(Request("old", ids(100, 50), max_new_tokens=5, ignore_eos=True, session_id="S"))
    s.step()                                   # prefilled, still running
    s.cache.close_session("S")
    s.run_until_idle()
    assert s.cache.session_states() == {"S": {"ref_tokens": 0, "closed": True}}
    # re-opened by a new request; an older one of the first generation finishing later tags nothing
    s.add_request(Request("old2", ids(900, 20), max_new_tokens=50, ignore_eos=True, session_id="S"))
    s.step()
    s.cache.close_session("S")
    s.add_request(Request("new", ids(100, 50), max_new_tokens=1, ignore_eos=True, session_id="S"))
    s.run_until_idle()
    st = s.cache.session_states()["S"]
    # only "new" (generation 3) tagged: its 50-token prompt path; old2's 69 tokens carry no reference
    assert st == {"ref_tokens": 50, "closed": False}


def test_aborted_requests_register_no_session_refs():
    s = make(1000)
    s.add_request(Request("a", ids(100, 50), max_new_tokens=50, ignore_eos=True, session_id="S"))
    s.step()
    s.abort("a")
    assert s.cache.session_states() == {} and s.cache.evictable == 50


# ---------------------------------------------------------------- sampling (sampling_params.py, sampler.py)
def test_sampled_outputs_depend_on_the_seed_and_greedy_on_the_prompt_alone():
    s = make(10_000, random_seed=7)
    p = ids(100, 40)
    reqs = {"g1": dict(temperature=0.0), "g2": dict(temperature=0.0, sampling_seed=5),
            "s5": dict(temperature=1.0, sampling_seed=5), "s5b": dict(temperature=1.0, sampling_seed=5),
            "s6": dict(temperature=1.0, sampling_seed=6), "r1": dict(temperature=1.0),
            "r2": dict(temperature=1.0)}
    for rid, kw in reqs.items():
        s.add_request(Request(rid, p, max_new_tokens=20, ignore_eos=True, **kw))
    s.run_until_idle()
    out = {rid: r.output_ids for rid, r in finished(s).items()}
    greedy = TokenModel().generate(p, 20)
    assert out["g1"] == out["g2"] == greedy
    assert out["s5"] == out["s5b"] == TokenModel().generate(p, 20, sample_key=5)
    assert len({tuple(out[k]) for k in ("s5", "s6", "r1", "r2")} | {tuple(greedy)}) == 5


# ---------------------------------------------------------------- priority (schedule_policy.py, evict_policy.py)
def test_priority_scheduling_orders_the_waiting_queue():
    """calc_priority -> _sort_by_priority_and_fcfs: (priority desc, queue entry time) with
    --enable-priority-scheduling; plain fcfs without it."""
    for enabled, expect in ((True, ["hi", "mid", "lo1", "lo2"]), (False, ["lo1", "hi", "lo2", "mid"])):
        s = make(10_000, max_running_requests=1, enable_priority_scheduling=enabled)
        for rid, prio in (("lo1", 0), ("hi", 9), ("lo2", 0), ("mid", 3)):
            s.add_request(Request(rid, ids(100 * (len(rid) + prio), 10), max_new_tokens=2, ignore_eos=True,
                                  priority=prio))
        order = []
        while not s.is_idle():
            b = s.step()
            if b.kind == "prefill":
                order += [r.rid for r, _ in b.items]
        assert order == expect, enabled


def test_priority_eviction_keeps_the_high_priority_requests_kv():
    """radix_cache.py insert: a node keeps the max priority of the requests through it; evict_policy.py
    PriorityStrategy: evict by (priority, last access)."""
    s = make(300, policy="priority")
    s.add_request(Request("hi", ids(1000, 100), max_new_tokens=1, priority=5))
    s.run_until_idle()
    s.add_request(Request("lo", ids(2000, 100), max_new_tokens=1, priority=0))
    s.run_until_idle()
    s.add_request(Request("new", ids(3000, 150), max_new_tokens=1))   # needs 50 more slots: evicts one
    s.run_until_idle()
    assert s.cache.cached_len(ids(1000, 100)) == 100 and s.cache.cached_len(ids(2000, 100)) == 0
    lru = make(300)
    for rid, start, n, prio in (("hi", 1000, 100, 5), ("lo", 2000, 100, 0), ("new", 3000, 150, 0)):
        lru.add_request(Request(rid, ids(start, n), max_new_tokens=1, priority=prio))
        lru.run_until_idle()
    assert lru.cache.cached_len(ids(1000, 100)) == 0 and lru.cache.cached_len(ids(2000, 100)) == 100


# ---------------------------------------------------------------- admission details (scheduler.py, PrefillAdder)
def test_batch_is_full_latches_until_a_running_request_leaves():
    """get_new_batch_prefill: NO_TOKEN sets batch_is_full while something runs; no prefill is tried until a
    running request leaves (filter_batch clears it), even when the decaying new_token_ratio would admit."""
    s = make(400)
    for rid, start, n in (("R1", 1000, 40), ("R2", 2000, 30), ("R3", 3000, 50)):
        s.add_request(Request(rid, ids(start, n), max_new_tokens=100))
    b = s.step()
    assert [r.rid for r, _ in b.items] == ["R1", "R2"] and s.batch_is_full
    steps = 0
    while len(s.running) == 2:
        assert s.step().kind == "decode"
        steps += 1
    # the budget had room long before (ratio 0.7 -> floor): 400 - 72 - 0.7 x 198 = 189 >= 150
    assert steps == 99 and [r.rid for r in s.waiting] == ["R3"]
    assert not s.batch_is_full
    s.run_until_idle()
    assert s.retracted_total == 0


def test_batch_prefixes_are_locked_before_its_kv_is_allocated():
    """prepare_for_extend allocates the batch's extend KV after add_one_req locked every prefix: admitting A
    cannot evict the prefix B of the same batch matched (the unrelated, newer Q goes instead)."""
    s = make(1000)
    for rid, start in (("P", 5000), ("Q", 9000)):
        s.add_request(Request(rid, ids(start, 400), max_new_tokens=1))
        s.run_until_idle()
    assert (s.cache.available, s.cache.evictable) == (200, 800)
    s.add_request(Request("A", ids(1, 300), max_new_tokens=10, ignore_eos=True))
    s.add_request(Request("B", ids(5000, 400) + ids(7000, 50), max_new_tokens=10, ignore_eos=True))
    b = s.step()
    assert [(r.rid, t) for r, t in b.items] == [("A", 300), ("B", 50)]
    assert b.items[1][0].cached_tokens == 400
    assert s.cache.cached_len(ids(9000, 400)) == 0 and s.cache.cached_len(ids(5000, 400)) == 400


def test_a_running_requests_prompt_is_shareable_once_its_prefill_ends():
    s = make(10_000)
    s.add_request(Request("A", ids(100, 500), max_new_tokens=200, ignore_eos=True))
    s.step()
    run_decodes(s, 3)
    s.add_request(Request("B", ids(100, 500) + ids(9000, 20), max_new_tokens=1))
    b = s.step()
    assert b.kind == "prefill" and b.items == [(b.items[0][0], 20)] and b.items[0][0].cached_tokens == 500


def test_new_token_ratio_semantics_for_ignore_eos():
    """0.5.17 schedule_policy.py: every running request reserves min(left, 4096) x new_token_ratio; 0.5.23
    reserves ignore_eos requests at 1.0."""
    for sem, budget in (("0.5.17", 900 - 499 * 0.7), ("0.5.23", 900 - 499)):
        s = make(1000, new_token_ratio_semantics=sem)
        s.add_request(Request("A", ids(1000, 100), max_new_tokens=500, ignore_eos=True))
        s.step()
        assert s.admission_budget() == pytest.approx(budget)
    with pytest.raises(ValueError):
        make(1000, new_token_ratio_semantics="0.6")


# ---------------------------------------------------------------- compute model
def test_prefill_time_grows_with_the_cached_prefix():
    """4 x layers x q_heads x head_dim FLOPs per extended token per attended token on top of 2 x params:
    +60% for a 32B model at a 30k prefix, ~+100% for 8B; a forward pass never beats reading the weights."""
    # (1 + a x 30500 / w) / (1 + a x 500 / w) - 1 with a / w = 1310720 / 65e9 (32B), 524288 / 16e9 (8B)
    for profile, extra in (("qwen2.5-32b-h100", 0.599), ("llama-3-8b-h100", 0.967)):
        attn, weights, fmin, _ = PROFILE_CONTEXT[profile]
        s = make(100_000, prefill_tokens_per_s=5400.0, prefill_attn_flops_per_ctx_token=attn,
                 prefill_weight_flops_per_token=weights, forward_min_ms=fmin)
        r0 = Request("x", (), 1)
        r0.kv_len = 1000
        r30 = Request("y", (), 1)
        r30.kv_len = 31000
        cold, warm = s.prefill_time_s([(r0, 1000)]), s.prefill_time_s([(r30, 1000)])
        assert warm / cold - 1 == pytest.approx(extra, abs=0.001)
        tiny = Request("z", (), 1)
        tiny.kv_len = 1
        assert s.prefill_time_s([(tiny, 1)]) == pytest.approx(fmin * 1e-3)


# ---------------------------------------------------------------- HiCache (hiradix_cache.py)
def hicache(max_total=1000, host=2000, policy="write_through", **cfg):
    s = make(max_total, **cfg)
    s.cache.attach_host(host, policy)
    return s


def test_hicache_write_through_then_load_back_instead_of_prefill():
    s = hicache(1000, 2000, kv_bytes_per_token=262144, hicache_h2d_bytes_per_s=50e9, prefill_tokens_per_s=5400.0)
    s.add_request(Request("t1", ids(100, 600), max_new_tokens=10, ignore_eos=True))
    s.run_until_idle()
    assert s.cache.backup_tokens_total == 609 and s.cache.host.tree_tokens == 609
    s.add_request(Request("other", ids(5000, 900), max_new_tokens=1))   # evicts t1 from the device
    s.run_until_idle()
    assert s.cache.cached_len(ids(100, 600)) == 0
    s.add_request(Request("t2", ids(100, 600) + ids(9000, 50), max_new_tokens=1))
    b = s.schedule()
    r = b.items[0][0]
    assert b.items[0][1] == 50 and r.loading == 600 and r.cached_tokens == 600
    # 600 tokens x 256 KiB at 50 GB/s = 3.1 ms, under the 50-token prefill's compute: max of the two
    assert s.load_back_tokens == 600 and s.host_hit_tokens == 600
    assert s.load_back_seconds == pytest.approx(600 * 262144 / 50e9)
    assert b.duration_s == pytest.approx(max(50 / 5400.0, 600 * 262144 / 50e9))
    s.commit(b)
    assert s.cache.cached_len(ids(100, 600)) == 600      # loaded back into the device tree


def test_hicache_host_pool_evicts_by_the_same_policy_and_write_back_waits_for_eviction():
    s = hicache(1000, 500)
    for k in range(3):
        s.add_request(Request(f"r{k}", ids(1000 * (k + 1), 200), max_new_tokens=1))
        s.run_until_idle()
    # host holds 500 tokens: the oldest 200-token entry (r0) was evicted from it (LRU)
    assert s.cache.host.tree_tokens == 400 and s.cache.host.cached_len(ids(1000, 200)) == 0
    wb = hicache(300, 1000, policy="write_back")
    wb.add_request(Request("a", ids(1000, 200), max_new_tokens=1))
    wb.run_until_idle()
    assert wb.cache.backup_tokens_total == 0
    wb.add_request(Request("b", ids(2000, 200), max_new_tokens=1))
    wb.run_until_idle()
    assert wb.cache.backup_tokens_total == 200 and wb.cache.host.cached_len(ids(1000, 200)) == 200


@pytest.mark.parametrize("seed", range(6))
def test_pressure_with_every_rule_keeps_the_pool_accounting_and_the_outputs(seed):
    """Random multi-turn sessions on a small pool with HiCache, priorities, closes, aborts and retractions: the
    pool identity holds after every batch, nothing leaks, and every finished greedy output is the model's."""
    import random
    rnd = random.Random(seed)
    s = hicache(3000, 4000, policy=rnd.choice(["write_through", "write_back"]),
                enable_priority_scheduling=bool(seed % 2), chunked_prefill_size=512)
    model = TokenModel()
    live, n = {}, 0
    for step in range(4000):
        if len(live) < 8 and rnd.random() < 0.3:
            n += 1
            sid = f"s{rnd.randrange(4)}"
            base = ids(10_000 * int(sid[1:]), rnd.randrange(50, 900))
            r = Request(f"r{n}", base + ids(500_000 + n * 100, rnd.randrange(1, 60)),
                        max_new_tokens=rnd.randrange(1, 300), ignore_eos=rnd.random() < 0.5, session_id=sid,
                        priority=rnd.randrange(3))
            s.add_request(r)
            live[r.rid] = r
        if rnd.random() < 0.02:
            s.cache.close_session(f"s{rnd.randrange(4)}")
        if live and rnd.random() < 0.01:
            s.abort(rnd.choice(list(live)))
        s.step()
        s.cache.check_invariants()
        for rid, r in finished(s).items():
            live.pop(rid, None)
            if r.finish_reason["type"] == "length":
                assert r.output_ids == model.generate(r.input_ids, r.max_new_tokens)
    s.run_until_idle()
    for rid, r in finished(s).items():
        if r.finish_reason["type"] == "length":
            assert r.output_ids == model.generate(r.input_ids, r.max_new_tokens)
    assert s.cache.num_used == 0 and s.cache.private == 0 and s.is_idle()
    s.cache.check_invariants()
    s.cache.host.check_invariants()
    assert s.retracted_total > 0 and s.load_back_tokens > 0     # the rules under test were exercised


def test_hicache_write_through_selective_backs_up_on_the_second_insert():
    """unified_radix_cache.py: write_through_threshold is 1 for write_through, 2 otherwise."""
    s = hicache(1000, 2000, policy="write_through_selective")
    s.add_request(Request("a", ids(1000, 200), max_new_tokens=1))
    s.run_until_idle()
    # inserted at prefill end and again at finish: 2 hits on the 200-token prompt
    assert s.cache.backup_tokens_total == 200
    s.add_request(Request("b", ids(1000, 200) + ids(5000, 100), max_new_tokens=1))
    s.run_until_idle()
    # b's own 100 tokens were inserted twice too (prefill end, finish): backed up; the prompt was already
    assert s.cache.backup_tokens_total == 300 and s.cache.host.cached_len(ids(1000, 200) + ids(5000, 100)) == 300


def test_hicache_prefill_chunks_count_no_hits():
    """hiradix_cache.py _inc_hit_count skips chunked inserts: a chunk's KV is backed up when its request's
    prefill ends, not per chunk."""
    s = hicache(5000, 8000, chunked_prefill_size=256)
    s.add_request(Request("long", ids(1000, 600), max_new_tokens=50, ignore_eos=True))
    assert s.step().items[0][1] == 256 and s.cache.tree_tokens == 256 and s.cache.backup_tokens_total == 0
    s.step()
    assert s.cache.backup_tokens_total == 0
    s.step()                                   # the last chunk ends the prefill: the whole prompt backed up
    assert s.cache.backup_tokens_total == 600
