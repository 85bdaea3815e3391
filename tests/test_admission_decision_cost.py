"""Properties of what makes the program policy's decisions cheap at fleet scale: each shortcut must decide as the
plain computation it replaces, over random inputs.

- Holdings keeps the last removal pending and hands its blocks over to the next add on the same place that
  starts with them: every figure (cost, total, grand total, has_block, places_with, what add and remove return)
  matches a plain model that recounts every holder, whatever the order of adds and removes (repeated blocks,
  shared prefixes, the same tuple held again, prompts that grow);
- the ledger's engines ordered by free room (free_rank) are the sort of every engine by free room;
- Ledger.first_fit returns, counts and holds what try_acquire place by place does;
- the coordinator ranks the other engines for a waiting turn (_others) as the sort of every engine by (its
  charge there, most free room) among those that could take its least charge and are not under pressure.
"""

import copy
from collections import Counter

from hypothesis import given, settings, strategies as st

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.ledger import Grant, Ledger
from kvgate.admission.program import ProgramCoordinator
from kvgate.admission.records import _Waiter
from kvgate.admission.working_set import Holdings

BT = 4  # tokens per block: small, so that random prompts share and repeat blocks


class Model:
    """Holdings recounted from scratch: holder -> (place, distinct blocks, tail)."""

    def __init__(self):
        self.h = {}

    def total(self, place):
        blocks = set()
        tail = 0
        for pl, bl, t in self.h.values():
            if pl == place:
                blocks |= set(bl)
                tail += t
        return len(blocks) * BT + tail

    def grand(self):
        return sum(self.total(pl) for pl in {v[0] for v in self.h.values()})

    def cost(self, place, blocks, tail):
        held = set().union(*(set(bl) for pl, bl, _ in self.h.values() if pl == place))
        return len(set(blocks) - held) * BT + max(0, tail)

    def places_with(self, block):
        return {pl for pl, bl, _ in self.h.values() if block in bl}


PLACE = st.sampled_from(["a", "b", None])
HOLDER = st.integers(0, 5)
# an op: (kind, holder, place, which tuple (an index into the tuples seen, or a new one), how to make it, tail)
OP = st.tuples(st.sampled_from(["add", "add", "add", "remove", "remove", "cost", "probe", "turn", "turn"]), HOLDER, PLACE,
               st.integers(0, 30), st.sampled_from(["same", "grow", "new", "repeat", "shrink"]),
               st.integers(-2, 9), st.lists(st.integers(0, 12), max_size=6))


@settings(max_examples=400, deadline=None)
@given(st.lists(OP, max_size=60))
def test_holdings_match_a_recount_whatever_the_order_of_adds_and_removes(ops):
    h, m = Holdings(BT), Model()
    seen = [()]  # tuples used so far: reused by identity (a lease's prompt held again as resident KV)
    passed = {}  # holder -> the tuple its last add passed
    for kind, holder, place, i, how, tail, fresh in ops:
        base = seen[i % len(seen)]
        if how == "same":
            blocks = base
        elif how == "grow":
            blocks = base + tuple(fresh)
        elif how == "repeat":
            blocks = tuple(fresh) + tuple(fresh[:2])
        elif how == "shrink":
            blocks = base[: len(base) // 2]
        else:
            blocks = tuple(fresh)
        seen.append(blocks)
        if kind == "turn" and holder in m.h:  # a turn ends (or starts): what one holder held, another holds
            place, blocks = m.h[holder][0], passed[holder]
            blocks = blocks + tuple(fresh) if how == "grow" else blocks
            m.h.pop(holder)
            h.remove(holder)
            holder = (holder + 1) % 6
            if how == "new":
                assert h.cost(place, blocks, tail) == m.cost(place, blocks, tail)  # asked before the add
        if kind in ("add", "turn"):
            passed[holder] = blocks
            want = m.cost(place, blocks, tail)
            m.h.pop(holder, None)
            want = m.cost(place, blocks, tail)
            assert h.add(holder, place, blocks, tail) == want
            m.h[holder] = (place, tuple(dict.fromkeys(blocks)), max(0, tail))
        elif kind == "remove":
            before = m.grand()
            m.h.pop(holder, None)
            assert h.remove(holder) == before - m.grand()
        elif kind == "cost":
            assert h.cost(place, blocks, tail) == m.cost(place, blocks, tail)
            assert h.cost(place, blocks, tail) == m.cost(place, blocks, tail)  # remembered: the same answer
        else:
            for b in fresh:
                assert h.places_with(b) == m.places_with(b)
                assert h.has_block(place, b) == (place in m.places_with(b))
        for pl in ("a", "b", None):
            assert h.total(pl) == m.total(pl)
        assert h.grand_total() == m.grand()
        assert len(h) == len(m.h)
        for k, (pl, bl, t) in m.h.items():
            assert h.place_of(k) == pl and h.size_of(k) == len(bl) * BT + t


def fleet(caps, now=0.0, usage=()):
    """A snapshot of engines e0.. with ``caps`` tokens each (the second pool of a capacity pair: a DP rank)."""
    engines = {}
    for i, c in enumerate(caps):
        u = usage[i] if i < len(usage) else 0.0
        pools = [(c, int(c * u), u)] if isinstance(c, int) else [(x, int(x * u), u) for x in c]
        engines[f"http://e{i}"] = EngineCapacity.from_pools(pools)
    return ClusterSnapshot.build(engines, now)


CAPS = st.lists(st.one_of(st.integers(50, 400), st.tuples(st.integers(50, 300), st.integers(50, 300))),
                min_size=1, max_size=6)
USAGE = st.lists(st.sampled_from([0.0, 0.5, 0.95]), max_size=6)
PROMPTS = [tuple(range(g * 100, g * 100 + n)) for g in range(3) for n in (0, 3, 10, 25)]
GRANT = st.tuples(st.integers(0, 7), st.integers(0, len(PROMPTS) - 1), st.integers(0, 120), st.booleans(),
                  st.booleans())


def loaded(caps, usage, grants):
    """A ledger over ``caps`` with ``grants`` applied: (place index, prompt, tail, forced, released again)."""
    lg = Ledger(headroom=0.9, pressure_threshold=0.92, block_tokens=BT, lease_ttl_s=1e9)
    lg.reconcile(fleet(caps, usage=usage), 0.0)
    places = lg.engine_places() + [None]
    lg.free_rank()  # built first: later grants must move it
    for n, (i, pi, tail, force, drop) in enumerate(grants):
        blocks = PROMPTS[pi]
        lg.try_acquire(f"g{n}", len(blocks) * BT + tail, 0.0, place=places[i % len(places)], blocks=blocks,
                       force=force)
        if drop and n % 3 == 0:
            lg.release(f"g{n - 1}", 0.0)
        if n % 4 == 1:
            lg.hold(f"r{n}", places[(i + 1) % len(places)], blocks, len(blocks) * BT + tail)
    return lg


@settings(max_examples=200, deadline=None)
@given(CAPS, USAGE, st.lists(GRANT, max_size=25))
def test_engines_by_free_room_are_the_sort_of_every_engine(caps, usage, grants):
    lg = loaded(caps, usage, grants)
    want = sorted((-lg.free_on(pl), i, pl) for i, pl in enumerate(lg.engine_places()))
    assert lg.free_rank().order() == want
    assert lg.free_rank().pressed == {pl for pl in lg.engine_places() if lg.usage_of(pl) >= lg.pressure_threshold}


@settings(max_examples=200, deadline=None)
@given(CAPS, USAGE, st.lists(GRANT, max_size=25), st.integers(0, len(PROMPTS) - 1), st.integers(0, 400),
       st.permutations(range(7)))
def test_first_fit_is_try_acquire_place_by_place(caps, usage, grants, pi, tail, order):
    lg = loaded(caps, usage, grants)
    places = lg.engine_places() + [None, "http://gone"]
    tried = [places[i % len(places)] for i in order]
    blocks = PROMPTS[pi]
    tokens = len(blocks) * BT + tail
    plain = copy.deepcopy(lg)
    g, where, refused = lg.first_fit("t", tokens, 0.0, tried, blocks)
    want_refused, want = [], (None, None)
    for pl in tried:
        r = plain.try_acquire("t", tokens, 0.0, place=pl, blocks=blocks)
        if isinstance(r, Grant):
            want = (r, pl)
            break
        want_refused.append((pl, r))
    assert [(pl, r.reason, r.tokens) for pl, r in refused] == [(pl, r.reason, r.tokens) for pl, r in want_refused]
    for pl, r in refused:
        if r.reason == "capacity_exhausted":
            assert r.charge == plain.charge(pl, tokens, blocks)
    assert where == want[1]
    assert (g is None) == (want[0] is None)
    if g is not None:
        assert (g.lease.place, g.lease.charged, g.lease.oversized) == (want[0].lease.place, want[0].lease.charged,
                                                                      want[0].lease.oversized)
    assert lg.stats(0.0)["refused"] == plain.stats(0.0)["refused"]
    assert lg.reserved == plain.reserved
    assert [lg.reserved_on(pl) for pl in places] == [plain.reserved_on(pl) for pl in places]


@settings(max_examples=200, deadline=None)
@given(CAPS, USAGE, st.lists(GRANT, max_size=25), st.integers(0, len(PROMPTS) - 1), st.integers(0, 400),
       st.integers(0, 7))
def test_a_waiting_turn_ranks_the_other_engines_as_the_plain_sort_does(caps, usage, grants, pi, tail, own):
    lg = loaded(caps, usage, grants)
    co = ProgramCoordinator(lg)
    places = lg.engine_places()
    blocks = PROMPTS[pi]
    w = _Waiter("t", "s", len(blocks) * BT + tail, len(blocks) * BT, places[own % len(places)], blocks, 0.0, False,
                1, movable=True)
    lb, th = co._lower_bound(w), lg.pressure_threshold

    def charge(pl):
        return lg.charge(pl, w.tokens, w.blocks) if lg.shares_start(pl, w.blocks) else w.tokens

    rest = [pl for pl in places if pl != w.place and lg.free_on(pl) >= lb and lg.usage_of(pl) < th]
    rest.sort(key=lambda pl: (charge(pl), -lg.free_on(pl)))  # stable: ties in the snapshot's order
    assert co._others(w) == rest
    assert Counter(co._others(w)) == Counter(rest)  # asked twice (costs remembered): the same answer
