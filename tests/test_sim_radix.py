"""Radix prefix cache (kvgate.sim.radix): match, LRU eviction, locks, accounting identity."""

import pytest
from hypothesis import given, settings, strategies as st

from kvgate.sim.radix import OutOfTokens, RadixCache


def put(c: RadixCache, ids, session=None, priority=0) -> int:
    """Simulate a finished request that computed KV for ``ids`` from scratch."""
    c.alloc(len(ids))
    return c.insert(tuple(ids), session_id=session, priority=priority, n_private=len(ids))


def test_match_prefix_lengths_and_dedup():
    c = RadixCache(100)
    assert put(c, range(1, 11)) == 10
    assert c.match_prefix((1, 2, 3, 4, 5, 99)).length == 5
    assert c.match_prefix(tuple(range(1, 12))).length == 10
    assert c.match_prefix((2, 3)).length == 0
    # second insert sharing 3 tokens adds only the 2 new ones; the duplicate KV is freed
    assert put(c, (1, 2, 3, 7, 8)) == 2
    assert c.tree_tokens == 12
    assert c.available == 88 and c.evictable == 12 and c.num_used == 0
    assert c.cached_len((1, 2, 3, 7, 8, 9)) == 5
    c.check_invariants()


def test_lru_eviction_order_and_counts():
    c = RadixCache(100)
    a, b, cc = (10, 11, 12), (20, 21, 22, 23), (30, 31)
    put(c, a), put(c, b), put(c, cc)
    c.match_prefix(a)  # a becomes most recently used: order b, cc, a
    assert c.evict(4) == 4
    assert (c.cached_len(a), c.cached_len(b), c.cached_len(cc)) == (3, 0, 2)
    assert c.evict(1) == 2  # whole leaf cc
    assert (c.cached_len(a), c.cached_len(cc)) == (3, 0)
    assert c.evicted_total == 6
    assert c.available == 97 and c.evictable == 3
    c.check_invariants()


def test_eviction_exposes_parent_after_children():
    c = RadixCache(100)
    put(c, (1, 2, 3, 4)), put(c, (1, 2, 5, 6))
    assert c.tree_tokens == 6
    assert c.evict(3) == 4  # two leaves of 2 tokens
    assert c.cached_len((1, 2, 3)) == 2
    assert c.evict(1) == 2
    assert c.tree_tokens == 0 and c.evicted_total == 6


def test_locked_nodes_are_not_evicted():
    c = RadixCache(100)
    a, b = tuple(range(1, 9)), tuple(range(50, 55))
    put(c, a), put(c, b)
    m = c.match_prefix(a)
    assert m.length == 8
    assert c.lock(m.node) == 8
    assert c.evictable == 5 and c.num_used == 8
    assert c.evict(100) == 5
    assert c.cached_len(a) == 8 and c.cached_len(b) == 0
    assert c.unlock(m.node) == 8
    assert c.evictable == 8 and c.num_used == 0
    c.check_invariants()


def test_alloc_evicts_then_raises_when_impossible():
    c = RadixCache(20)
    put(c, range(1, 16))
    c.alloc(10)  # needs 5 more than available -> evicts the 15-token leaf
    assert c.evicted_total == 15 and c.private == 10 and c.available == 10
    with pytest.raises(OutOfTokens):
        c.alloc(11)


def test_priority_policy_evicts_low_priority_first():
    c = RadixCache(100, session_mode="off", eviction_policy="priority")
    put(c, (1, 2, 3), priority=5)
    put(c, (7, 8), priority=1)
    c.match_prefix((7, 8))  # more recent but lower priority
    assert c.evict(1) == 2
    assert c.cached_len((1, 2, 3)) == 3 and c.cached_len((7, 8)) == 0


ops = st.lists(st.tuples(st.sampled_from(["put", "match_lock", "unlock", "evict", "alloc",
                                          "free", "close"]),
                         st.lists(st.integers(0, 5), min_size=1, max_size=12),
                         st.integers(0, 40), st.sampled_from([None, "s1", "s2"])),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from([("0.5.17", "lru"), ("0.5.15", "priority"), ("off", "lru")]))
def test_accounting_identity_random_ops(seq, mode):
    c = RadixCache(64, session_mode=mode[0], eviction_policy=mode[1])
    locked = []
    for op, ids, n, sess in seq:
        if op == "put":
            if c.can_alloc(len(ids)):
                put(c, ids, session=sess, priority=n)
        elif op == "match_lock":
            m = c.match_prefix(tuple(ids))
            c.lock(m.node)
            locked.append(m.node)
        elif op == "unlock" and locked:
            c.unlock(locked.pop(n % len(locked)))
        elif op == "evict":
            before = c.tree_tokens
            got = c.evict(n)
            assert before - c.tree_tokens == got
        elif op == "alloc":
            if c.can_alloc(n):
                c.alloc(n)
        elif op == "free":
            c.free(min(n, c.private))
        elif op == "close" and sess:
            before_used = c.num_used
            c.close_session(sess)
            assert c.num_used == before_used  # close never lowers num_used
        c.check_invariants()
        assert c.num_used == c.max_total - (c.available + c.evictable)
        assert c.num_used == c.protected + c.private
