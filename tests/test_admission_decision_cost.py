"""Properties of what makes the program policy's decisions cheap at fleet scale: each shortcut must decide as the
plain computation it replaces, over random inputs.

- Holdings keeps the last removal pending and hands its blocks over to the next add on the same place that
  starts with them: every figure (cost, total, grand total, has_block on every place, the places a first block
  starts, what add and remove return) matches a plain model that recounts every holder, whatever the order of
  adds and removes (repeated blocks, shared prefixes, the same tuple held again, prompts that grow);
- the ledger's engines ordered by free room (free_rank) are the sort of every engine by free room, read once or
  between changes that touch one engine to all of them;
- Ledger.first_fit returns, counts and holds what try_acquire place by place does;
- the coordinator ranks the other engines for a waiting turn (_others) as the sort of every engine by (its
  charge there, most free room) among those that could take its least charge and are not under pressure.
- Holdings.changed_since names every place a change reached since a version (or None once the log no longer
  reaches back that far);
- a waiting turn's remembered refusals (_refused_again, its own place's: _own_refused_again) decide as asking
  every engine again: two coordinators,
  one of them asking every time, over random fleets, programs and events give the same decisions, pauses,
  counters, ledger refusals and refusal records at every step;
- first_fit told where a prompt's start is held (start_held) charges the whole turn elsewhere without a walk of
  its blocks: the same as walking them, over chained prompts (kvgate's); and victim_heap pops an overflowing
  place's in-tool programs in victim_order's order: two coordinators, one walking every engine and sorting every
  victim (the code before), give the same decisions, pauses and counters over random fleets, programs, events
  and victim rules;
- a turn is refused without asking the engines (_no_room, at submit and in the pump) only when, asked, every
  engine it may go to refuses it.
"""

import copy
import heapq
import math
from collections import Counter
from types import SimpleNamespace
from unittest import mock

from hypothesis import given, settings, strategies as st

from kvgate.admission import free_rank
from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.coordinator import Kind
from kvgate.admission.ledger import Grant, Ledger
from kvgate.admission.program import ProgramCoordinator
from kvgate.admission.records import ProgramState, _Waiter
from kvgate.admission.victims import VICTIM_RULES, Groups, VictimRule, victim_heap, victim_order
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

    def places_starting_with(self, block):
        return {pl for pl, bl, _ in self.h.values() if bl[:1] == (block,)}


PLACE = st.sampled_from(["a", "b", None])
HOLDER = st.integers(0, 5)
# an op: (kind, holder, place, which tuple (an index into the tuples seen, or a new one), how to make it, tail)
OP = st.tuples(st.sampled_from(["add", "add", "add", "remove", "remove", "cost", "probe", "turn", "turn"]), HOLDER,
               st.sampled_from(["a", "a", "b", None]),
               st.integers(0, 30), st.sampled_from(["same", "grow", "new", "repeat", "shrink"]),
               st.integers(-2, 9), st.lists(st.integers(0, 12), max_size=6))


@settings(max_examples=400, deadline=None)
@given(st.lists(OP, min_size=10, max_size=60))
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
            h.remove(holder)  # pending while the place has other holders: the reads below meet it
            for b in fresh + list(blocks[:3]):
                assert {pl for pl in ("a", "b", None) if h.has_block(pl, b)} == m.places_with(b)
                assert h.places_starting_with(b) == m.places_starting_with(b)
                assert h.has_block(place, b) == (place in m.places_with(b))
            # the next holder: a new one (the next turn's lease) when there is one, so the add takes the blocks
            # over from the pending removal
            holder = next((k for k in range(6) if k not in m.h), (holder + 1) % 6)
            if how != "same":
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
            for b in fresh + list(blocks[:1]):
                assert {pl for pl in ("a", "b", None) if h.has_block(pl, b)} == m.places_with(b)
                assert h.places_starting_with(b) == m.places_starting_with(b)
                assert h.has_block(place, b) == (place in m.places_with(b))
        for pl in ("a", "b", None):
            assert h.total(pl) == m.total(pl)
        assert h.grand_total() == m.grand()
        assert len(h) == len(m.h)
        for k, (pl, bl, t) in m.h.items():
            assert h.place_of(k) == pl and h.size_of(k) == len(bl) * BT + t


CHAINS = [tuple((c << 20) | k for k in range(40)) for c in range(3)]  # three prompts' chains: prefixes of each held


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "add", "remove", "turn"]), HOLDER, PLACE, st.integers(0, 2),
                          st.integers(0, 40), st.integers(0, 9)), max_size=40),
       st.lists(st.tuples(PLACE, st.integers(0, 2), st.integers(0, 40), st.integers(0, 6), st.integers(-2, 9)),
                min_size=1, max_size=8))
def test_a_chained_prompts_held_prefix_found_by_a_search_costs_what_the_walk_does(ops, asks):
    """Holdings.cost_chained over chain-hashed prompts (every holder holds a prefix of one chain, as kvgate's
    prompts are) equals cost() and a recount, whatever the holders, removals pending and prompts asked about
    (prefixes of a chain, some going on with blocks no one holds)."""
    h, m = Holdings(BT), Model()
    for kind, holder, place, c, n, tail in ops:
        blocks = CHAINS[c][:n]
        if kind == "remove" or (kind == "turn" and holder in m.h):
            m.h.pop(holder, None)
            h.remove(holder)  # left pending: the asks below meet it
        if kind != "remove":
            m.h.pop(holder, None)
            h.add(holder, place, blocks, tail)
            m.h[holder] = (place, blocks, max(0, tail))
    for place, c, n, extra, tail in asks:
        blocks = CHAINS[c][:n] + tuple((1 << 40) | (c << 20) | k for k in range(extra))
        want = m.cost(place, blocks, tail)
        assert h.cost_chained(place, blocks, tail) == want
        assert h.cost_chained(place, blocks, tail) == want  # remembered: the same
        assert h.cost(place, blocks, tail) == want


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
    assert lg.free_rank().smallest_ceiling == min(lg.ceiling_of(pl) for pl in lg.engine_places())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(50, 400), min_size=1, max_size=16), st.sampled_from([0, 1, 3, 8, 10 ** 9]),
       st.lists(st.tuples(st.sampled_from(["grant", "release", "hold", "read"]), st.integers(0, 12),
                          st.integers(0, 17), st.integers(0, len(PROMPTS) - 1), st.integers(0, 120)),
                min_size=10, max_size=60))
def test_engines_by_free_room_stay_sorted_when_read_between_changes(caps, few, ops):
    """Read between changes touching one to every engine (each path of order(): moved one by one, or re-keyed
    and sorted at once), the order is the sort of every engine by free room."""
    lg = Ledger(headroom=0.9, pressure_threshold=0.92, block_tokens=BT, lease_ttl_s=1e9)
    lg.reconcile(fleet(caps), 0.0)
    places = lg.engine_places() + [None]
    with mock.patch.object(free_rank, "_FEW", few):
        lg.free_rank()
        for n, (kind, k, i, pi, tail) in enumerate(ops):
            pl, blocks = places[i % len(places)], PROMPTS[pi]
            if kind == "grant":
                lg.try_acquire(f"g{k}", len(blocks) * BT + tail, 0.0, place=pl, blocks=blocks, force=True)
            elif kind == "release":
                lg.release(f"g{k}", 0.0)
            elif kind == "hold":
                lg.hold(f"r{k}", pl, blocks, len(blocks) * BT + tail)
            else:
                assert lg.free_rank().order() == sorted((-lg.free_on(p), j, p)
                                                        for j, p in enumerate(lg.engine_places()))
        assert lg.free_rank().order() == sorted((-lg.free_on(p), j, p) for j, p in enumerate(lg.engine_places()))


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
    walked = copy.deepcopy(lg)
    g, where, refused = lg.first_fit("t", tokens, 0.0, tried, blocks,
                                     start_held=lg.places_holding(blocks[0]) if blocks else set())
    g2, where2, refused2 = walked.first_fit("t", tokens, 0.0, tried, blocks)  # every place's blocks walked
    assert [(pl, r.reason, r.tokens, r.charge) for pl, r in refused] == \
        [(pl, r.reason, r.tokens, r.charge) for pl, r in refused2]
    assert (where, g and g.lease.charged) == (where2, g2 and g2.lease.charged)
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
       st.integers(0, 7), st.integers(-1, 24))
def test_a_waiting_turn_ranks_the_other_engines_as_the_plain_sort_does(caps, usage, grants, pi, tail, own, drop):
    """``drop``: a grant released last, its removal left pending (the charges read through it)."""
    lg = loaded(caps, usage, grants)
    if drop >= 0:
        lg.release(f"g{drop}", 0.0)
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
    assert list(co._others(w)) == rest
    assert Counter(co._others(w)) == Counter(rest)  # asked twice (costs remembered): the same answer


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "add", "remove", "turn", "probe"]), HOLDER, PLACE,
                          st.integers(0, 3), st.integers(0, 9)), max_size=60), st.sampled_from([4, 4096]))
def test_changed_since_names_every_place_a_change_reached(ops, kept):
    import kvgate.admission.working_set as ws
    old, ws._LOG_KEPT = ws._LOG_KEPT, kept  # a short log: older versions must answer None, not a wrong set
    try:
        h = Holdings(BT)
        at: list[tuple[int, list]] = []  # (version, the places changed since it)
        for kind, holder, place, g, tail in ops:
            before = h.place_of(holder) if h.holds(holder) else "none"
            at.append((h.version, []))
            blocks = PROMPTS[g * 4 % len(PROMPTS)]
            if kind == "add" or (kind == "turn" and before == "none"):
                h.add(holder, place, blocks, tail)
                reached = [place] if before == "none" else [before, place]
            elif kind == "remove" or kind == "turn":
                h.remove(holder)
                reached = [] if before == "none" else [before]
                if kind == "turn" and before != "none":  # a turn's end: the next holder takes the same blocks
                    if h.holds(("next", holder)):
                        reached.append(h.place_of(("next", holder)))  # it held elsewhere: that is released first
                    h.add(("next", holder), before, blocks, tail)
                    reached.append(before)
            else:
                reached = []
                h.cost(place, blocks, tail)  # reads: no change
            for _, since in at:
                since.extend(reached)
            for v, since in at:
                got = h.changed_since(v)
                if got is None:
                    assert h.version - v > kept // 2  # only versions older than what the log keeps
                else:
                    assert got == set(since)
            assert h.changed_since(h.version) == set()
    finally:
        ws._LOG_KEPT = old


class Plain(ProgramCoordinator):
    """The coordinator without its remembered refusals: every waiting turn asks every engine on every pump."""

    def _own_refused_again(self, w, changed):
        return None

    def _refused_again(self, w, changed, own_refusal):
        return False


def chained(group, first, own, n):
    """A prompt's block hashes, chained as kvgate's are: the group's first prompt, then the program's own."""
    return tuple((group << 20) | k for k in range(min(n, first))) + tuple((1 << 40) | (own << 20) | k
                                                                          for k in range(first, n))


EVENT = st.tuples(st.sampled_from(["turn", "turn", "turn", "done", "done", "done", "forget", "pump", "reconcile"]),
                  st.integers(0, 9), st.integers(0, 40), st.floats(0.0, 3.0), st.sampled_from([0.0, 0.0, 0.5, 0.95]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(40, 300), min_size=2, max_size=6), st.lists(st.integers(2, 20), min_size=10, max_size=10),
       st.lists(EVENT, min_size=60, max_size=200), st.sampled_from([3.0, 1e6, 1e6]), st.sampled_from([None, None, 2.0]))
def test_remembered_refusals_decide_as_asking_every_engine_again(caps, firsts, events, max_wait, reclaim):
    """Two coordinators over the same fleet, programs (GRPO pairs sharing a first prompt, prompts growing
    turn by turn, kvgate placing their calls) and events in the same order, one remembering a waiting turn's
    refusals (_refused_again), one asking every engine again: the same decisions, pauses, counters, ledger
    refusals and per-pump refusal records at every step."""
    side_by_side((ProgramCoordinator, Plain), caps, firsts, events, max_wait, reclaim)


def side_by_side(classes, caps, firsts, events, max_wait, reclaim, victim="ahead"):
    """Drive a coordinator of each of two ``classes`` through ``events``, asserting they decide alike at every
    step; returns the pauses and in-tool pauses counted (how much of the pausing path the events reached)."""
    cos = []
    for cls in classes:
        lg = Ledger(headroom=0.9, pressure_threshold=0.92, block_tokens=BT, lease_ttl_s=1e9, stale_after_s=1e9)
        co = cls(lg, max_wait_s=max_wait, reclaim_after_s=reclaim, victim=victim)
        co.reconcile(fleet(caps), 0.0)
        cos.append(co)
    places = cos[0].ledger.engine_places()
    now, n = 0.0, 0
    length = [0] * 10  # each program's prompt, in blocks
    inflight: dict[int, list] = {}  # program -> its tickets granted
    waiting: dict = {}  # ticket -> program

    def same(outs):
        a, b = outs
        assert a == b
        for co in cos:
            co_acts = co.take_actions()
            outs.append([(x.kind, x.session_id, x.place) for x in co_acts])
        assert outs[2] == outs[3]
        x, y = cos
        assert x.counters == y.counters
        assert x.ledger.stats(now)["refused"] == y.ledger.stats(now)["refused"]
        assert x.ledger.reserved == y.ledger.reserved
        assert (x._failed, x._failed_max) == (y._failed, y._failed_max)
        assert x.waiting_tickets() == y.waiting_tickets()

    def view(ds):
        return [(d.ticket, d.kind, d.tokens, d.reason, d.lease and (d.lease.place, d.lease.charged, d.lease.forced))
                for d in ds]

    def went(views):  # turns that left the queue; those with a lease run until their "done"
        for ticket, _, _, _, lease in views:
            prog = waiting.pop(ticket)
            if lease is not None:
                inflight.setdefault(prog, []).append(ticket)

    for kind, prog, grow, dt, usage in events:
        now += dt
        if kind == "turn" and not inflight.get(prog) and prog not in waiting.values():
            n += 1
            length[prog] += 1 + grow // 4
            blocks = chained(prog // 2, firsts[prog // 2 * 2], prog, length[prog])
            tokens = len(blocks) * BT + grow % 7
            outs = [view([co.submit(f"t{n}", tokens, False, now, place=places[prog % len(places)], blocks=blocks,
                                    session_id=f"s{prog}", prompt_tokens=len(blocks) * BT, movable=True)])
                    for co in cos]
            same(outs)
            waiting[f"t{n}"] = prog
            if outs[0][0][1] is Kind.WAIT:
                outs = [view(co.pump(now)) for co in cos]  # the gate pumps once as a turn starts to wait
                same(outs)
            went(outs[0])
        elif kind == "done" and inflight.get(prog):
            meta = {"prompt_tokens": grow * 3, "completion_tokens": grow % 5, "cached_tokens": 0}
            t = inflight[prog].pop(0)
            outs = [view(co.release(t, now, meta)) for co in cos]
            same(outs)
            went(outs[0])
        elif kind == "forget" and not inflight.get(prog):
            for co in cos:
                co.forget(f"s{prog}", now)
            same([[], []])
        elif kind == "reconcile":
            snap = fleet(caps, now, usage=[usage if i == prog % len(caps) else 0.0 for i in range(len(caps))])
            outs = [view(co.reconcile(snap, now)) for co in cos]
            same(outs)
            went(outs[0])
        else:
            outs = [view(co.pump(now)) for co in cos]
            same(outs)
            went(outs[0])
    return cos[0].counters["pause"]


class Walking(ProgramCoordinator):
    """The coordinator before these shortcuts: first_fit walks a waiting turn's blocks on every engine it tries,
    and an overflowing place sorts all its in-tool programs by the victim rule."""

    _walk_every_place = True

    def _relieve(self, place, now):  # every in-tool program sorted, then the running ones: no heap
        over = self._overflow(place, now)
        on = sorted(self._on.get(place, {}).values(), key=lambda p: p.n) if over > 0 else []
        for state in (ProgramState.IN_TOOL, ProgramState.LIVE):
            for p in self._victims([p for p in on if p.state is state and not p.marked], now):
                if over <= 0:
                    return
                if state is ProgramState.IN_TOOL:
                    over -= self._pause(p, now)
                else:
                    p.marked = True
                    self._count("marked", now)
                    over -= sum(t for t, *_ in p.inflight.values())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(40, 300), min_size=2, max_size=6), st.lists(st.integers(2, 20), min_size=10, max_size=10),
       st.lists(EVENT, min_size=60, max_size=200), st.sampled_from([3.0, 1e6, 1e6]), st.sampled_from([None, None, 2.0]),
       st.sampled_from(VICTIM_RULES))
def test_charges_where_the_start_is_not_held_and_the_victim_heap_decide_as_walking_and_sorting(
        caps, firsts, events, max_wait, reclaim, victim):
    """The same fleets, programs and events as above, one coordinator with the shortcuts (the whole turn charged
    without a walk where its prompt's start is not held; the victims popped off a heap), one without: the same
    decisions, pauses, counters, ledger refusals and refusal records at every step."""
    side_by_side((ProgramCoordinator, Walking), caps, firsts, events, max_wait, reclaim, victim)


def test_the_side_by_side_events_pause_programs():
    """The events above reach the pausing path (the property would hold vacuously otherwise): a fixed run pauses."""
    events = [("turn", i % 10, 30, 0.1, 0.0) for i in range(40)] + [("done", i % 10, 30, 0.1, 0.0) for i in range(40)]
    events += [("turn", i % 10, 40, 0.1, 0.0) for i in range(40)]
    assert side_by_side((ProgramCoordinator, Walking), [60, 60], [8] * 10, events, 1e6, None) >= 3


GROUP_PROGS = st.lists(st.tuples(st.sampled_from([None, "G", "H", "K"]), st.integers(0, 6), st.integers(0, 500),
                                 st.floats(0.0, 20.0), st.sampled_from([5.0, 15.0, math.inf])), min_size=0, max_size=30)


@settings(max_examples=300, deadline=None)
@given(GROUP_PROGS, st.sampled_from(VICTIM_RULES), st.randoms(use_true_random=False))
def test_the_victim_heap_pops_in_victim_order(progs, rule, rnd):
    """victim_heap popped to the end is victim_order over the programs in join order (``n``), whatever order
    they are given in, whatever the groups, turns, sizes, idle times and overdue times (ties included)."""
    groups, ps = Groups(), []
    for n, (g, turns, resident, since, overdue) in enumerate(progs):
        p = SimpleNamespace(sid=f"s{n}", n=n, group=g, turns=turns, resident=resident, since=since, overdue_at=overdue)
        ps.append(p)
        if g is not None:
            groups.join(g, p.sid, turns)
    for g in ("G", "H"):  # a group with members elsewhere (not among the programs ordered)
        groups.join(g, "elsewhere-" + g, 3)
    byid = {p.sid: p for p in ps}
    byid.update({"elsewhere-G": SimpleNamespace(turns=3), "elsewhere-H": SimpleNamespace(turns=3)})
    want = [p.sid for p in victim_order(ps, VictimRule(rule), 10.0, groups, byid)]
    given = ps[:]
    rnd.shuffle(given)
    heap = victim_heap(given, VictimRule(rule), 10.0, groups)
    assert [heapq.heappop(heap)[-1].sid for _ in range(len(heap))] == want


class Checking(ProgramCoordinator):
    """_no_room checked against asking: whenever it refuses a turn unasked, every engine the turn may go to (its
    own, and every other not under pressure) refuses it, asked on a copy of the ledger."""

    passed_by = 0

    def _no_room(self, w):
        if not super()._no_room(w):
            return False
        lg = copy.deepcopy(self.ledger)
        pressed = lg.free_rank().pressed
        for pl in [w.place, *(pl for pl in lg.engine_places() if pl != w.place and pl not in pressed)]:
            r = lg.try_acquire(w.ticket, w.tokens, 0.0, place=pl, blocks=w.blocks)
            assert not isinstance(r, Grant), (w, pl)
        type(self).passed_by += 1
        return True


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(40, 300), min_size=2, max_size=6), st.lists(st.integers(2, 20), min_size=10, max_size=10),
       st.lists(EVENT, min_size=60, max_size=200), st.sampled_from([3.0, 1e6, 1e6]), st.sampled_from([None, None, 2.0]))
def test_a_waiting_turn_passed_by_for_want_of_room_is_refused_by_every_engine_it_may_go_to(
        caps, firsts, events, max_wait, reclaim):
    """A turn whose whole turn is more than any engine's free room and whose charge is more than the free room of
    each engine that holds its prompt's start is refused without asking the engines (_no_room, at submit and in
    the pump): asked, every one of them refuses it; and the coordinator decides as one that walks every engine."""
    side_by_side((Checking, Walking), caps, firsts, events, max_wait, reclaim)


def test_the_side_by_side_events_pass_waiting_turns_by():
    """The property above is not vacuous: a fleet kept full refuses turns unasked."""
    Checking.passed_by = 0
    events = [("turn", i % 10, 30, 0.1, 0.0) for i in range(40)] + [("pump", 0, 0, 0.1, 0.0)] * 5
    side_by_side((Checking, Walking), [60, 60], [8] * 10, events, 1e6, None)
    assert Checking.passed_by >= 3
