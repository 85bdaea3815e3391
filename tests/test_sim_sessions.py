"""Session radix cache close semantics: 0.5.17 (references) vs 0.5.15 (bulk free)."""

import pytest

from kvgate.sim.radix import TOMBSTONE_MAX, RadixCache, SessionConfigError


def put(c, ids, session=None):
    c.alloc(len(ids))
    return c.insert(tuple(ids), session_id=session, n_private=len(ids))


A = tuple(range(100, 110))
B = tuple(range(200, 210))


def test_0517_closed_session_evicted_before_live_one_despite_lru():
    c = RadixCache(1000, session_mode="0.5.17")
    put(c, B, "b")
    put(c, A, "a")
    c.match_prefix(A)  # a is the most recently used
    used, avail = c.num_used, c.available
    assert c.close_session("a") == 0
    assert (c.num_used, c.available) == (used, avail)  # close frees nothing by itself
    assert c.evict(1) == 10
    assert c.cached_len(A) == 0 and c.cached_len(B) == 10
    assert c.evicted_total == 10 and c.closes_received == 1


def test_plain_lru_without_session_cache_evicts_older_live_one():
    c = RadixCache(1000, session_mode="off")
    put(c, B, "b")
    put(c, A, "a")
    c.match_prefix(A)
    c.close_session("a")
    assert c.evict(1) == 10
    assert c.cached_len(A) == 10 and c.cached_len(B) == 0


def test_0517_ref_count_orders_eviction_and_tombstone():
    c = RadixCache(1000, session_mode="0.5.17")
    put(c, A, "x")
    put(c, A, "y")           # A: two references
    put(c, B, "z")           # B: one reference, more recent
    assert c.evict(1) == 10  # fewer refs first
    assert c.cached_len(A) == 10 and c.cached_len(B) == 0
    c.close_session("x")
    c.close_session("x")     # idempotent
    put(c, A, "x")           # tombstoned id adds no reference
    assert c.session_ref_tokens("x") == 0 and c.session_ref_tokens("y") == 10
    for i in range(TOMBSTONE_MAX + 1):
        c.close_session(f"t{i}")
    assert len(c.closed) == TOMBSTONE_MAX and "x" not in c.closed and "t0" not in c.closed


def test_0515_close_frees_unshared_chain_keeps_shared_prefix():
    c = RadixCache(1000, session_mode="0.5.15", eviction_policy="priority")
    prefix = tuple(range(1, 21))
    a_ids, b_ids = prefix + tuple(range(100, 130)), prefix + tuple(range(200, 210))
    put(c, a_ids, "a")
    put(c, b_ids, "b")
    avail = c.available
    assert c.tree_tokens == 60
    assert c.close_session("a") == 30
    assert c.available == avail + 30
    assert c.cached_len(a_ids) == 20 and c.cached_len(b_ids) == 30
    assert c.session_freed_total == 30 and c.evicted_total == 30
    assert c.close_session("a") == 0
    c.check_invariants()


def test_0515_close_skips_locked_and_nodes_with_children():
    c = RadixCache(1000, session_mode="0.5.15", eviction_policy="priority")
    put(c, A, "a")
    m = c.match_prefix(A)
    c.lock(m.node)
    assert c.close_session("a") == 0
    c.unlock(m.node)
    assert c.cached_len(A) == 10
    put(c, A[:5], "d")
    put(c, A[:5] + (7, 7), None)   # untagged child under d's node -> shared
    assert c.close_session("d") == 0
    assert c.cached_len(A[:5] + (7, 7)) == 7


def test_0515_requires_priority_policy():
    with pytest.raises(SessionConfigError):
        RadixCache(100, session_mode="0.5.15", eviction_policy="lru")
    RadixCache(100, session_mode="off", eviction_policy="lru")
