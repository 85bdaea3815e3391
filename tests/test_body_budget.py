"""kvgate.proxy.body_budget, the server's in-flight body budget, with an injected clock and no sockets."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvgate.proxy.body_budget import BodyBudget, Ticket


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_room_first_come_first_served_and_one_large_body_alone():
    clock = Clock()
    b = BodyBudget(100, 5.0, clock)
    a, c, d = Ticket("a"), Ticket("c"), Ticket("d")
    assert b.take(a, 60) and b.held == 60
    assert not b.take(c, 50) and b.waiting == 1  # no room: waits
    assert not b.take(d, 10)  # room for 10, but c waits first: no overtaking
    assert b.release(a) == [c, d] and b.held == 60 and (c.held, d.held) == (50, 10)
    big = Ticket("big")
    b.release(c), b.release(d)
    assert b.take(big, 1000) and b.held == 1000  # larger than the budget: goes when nothing else holds any
    assert not b.take(Ticket(), 1)
    assert [t.owner for t in b.release(big)] == [None] and b.held == 1


def test_a_wait_past_wait_s_is_refused_and_lets_the_next_in():
    clock = Clock()
    b = BodyBudget(100, 5.0, clock)
    a, late, next_ = Ticket("a"), Ticket("late"), Ticket("next")
    b.take(a, 90)
    b.take(late, 50)
    clock.t += 1
    b.take(next_, 10)
    clock.t += 4
    refused, granted = b.expire()
    assert refused == [late] and granted == [next_] and late.held == late.want == 0
    assert b.expire() == ([], []) and b.held == 100
    b.release(next_)
    b.release(late)  # refused already: gives back nothing, breaks nothing
    assert b.held == 90 and b.waiting == 0


@given(st.lists(st.tuples(st.sampled_from(["take", "release", "tick"]), st.integers(0, 7), st.integers(1, 150)),
                max_size=60))
def test_the_budget_is_never_overdrawn_and_every_byte_comes_back(ops):
    clock = Clock()
    b = BodyBudget(100, 3.0, clock)
    tickets = [Ticket(i) for i in range(8)]
    for op, i, n in ops:
        t = tickets[i]
        if op == "take" and not t.want:
            b.take(t, n)
        elif op == "release":
            b.release(t)
        else:
            clock.t += n / 50
            b.expire()
        holders = [x for x in tickets if x.held]
        assert b.held == sum(x.held for x in tickets)
        assert b.held <= 100 or len(holders) == 1  # past the budget only a body alone
        assert b.held > 0 or b.waiting == 0  # nobody waits while the budget is empty
    for t in tickets:
        b.release(t)
    assert b.held == 0 and b.waiting == 0



@given(st.lists(st.tuples(st.sampled_from(["admit", "release", "tick"]), st.integers(0, 5), st.integers(1, 150)),
                max_size=60))
def test_admit_is_a_new_ticket_then_take(ops):
    """admit(owner, n) (the server's one call a request with a body) leaves the budget, the queue and the ticket
    as Ticket(owner) then take(ticket, n) does, whatever came before."""
    clocks = Clock(), Clock()
    one, two = BodyBudget(100, 3.0, clocks[0]), BodyBudget(100, 3.0, clocks[1])
    mine: dict[int, Ticket] = {}
    theirs: dict[int, Ticket] = {}
    for op, i, n in ops:
        if op == "admit" and i not in mine:
            mine[i] = t = one.admit(i, n)
            theirs[i] = u = Ticket(i)
            assert (t.want == 0) == two.take(u, n)
        elif op == "release" and i in mine:
            assert [x.owner for x in one.release(mine.pop(i))] == [x.owner for x in two.release(theirs.pop(i))]
        elif op == "tick":
            for c in clocks:
                c.t += n / 50
            (late1, got1), (late2, got2) = one.expire(), two.expire()
            assert [x.owner for x in late1] == [x.owner for x in late2]
            assert [x.owner for x in got1] == [x.owner for x in got2]
        assert (one.held, one.waiting) == (two.held, two.waiting)
        assert {k: (t.held, t.want, t.since, t.owner) for k, t in mine.items()} == \
               {k: (t.held, t.want, t.since, t.owner) for k, t in theirs.items()}
