"""kvgate.fleet.decode_naming: which X-SMG-Target-Worker index names a PD decode worker on each route, learned
from smg's answers (pure, no sockets). The real smg's behaviour is checked in tests/test_e2e_pd.py."""

import random

from hypothesis import given, settings, strategies as st

from kvgate.fleet.decode_naming import NAMING, OFF, TRYING, DecodeNaming
from kvgate.fleet.discovery import Engine

ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions")


def _fleet(n_decode: int, n_prefill: int = 1, ids=None, unhealthy=()) -> list[Engine]:
    ids = ids or [f"id-{i:03d}" for i in range(n_decode)]
    return [*(Engine(f"http://p:{i}", "prefill", worker_id=f"p-{i}") for i in range(n_prefill)),
            *(Engine(f"http://d:{i}", "decode", i not in unhealthy, worker_id=ids[i]) for i in range(n_decode))]


def test_first_guesses_are_the_listed_order_on_generate_and_the_id_order_elsewhere():
    n = DecodeNaming()
    n.set_workers(_fleet(3, ids=["c", "a", "b"], unhealthy=()))
    assert [n.index(f"http://d:{i}", "/generate", 0.0) for i in range(3)] == [0, 1, 2]
    assert [n.index(f"http://d:{i}", "/v1/chat/completions", 0.0) for i in range(3)] == [2, 0, 1]
    assert n.index("http://p:0", "/generate", 0.0) is None  # a prefill worker is never named
    n.set_workers(_fleet(3, unhealthy=(1,)))  # an unhealthy worker is not counted (nor is it smg's)
    assert [n.index(f"http://d:{i}", "/generate", 0.0) for i in range(3)] == [0, None, 1]


def test_not_supported_without_prefill_workers_or_with_dp_ranks():
    n = DecodeNaming()
    n.set_workers([Engine("http://e:1"), Engine("http://e:2")])
    assert not n.supported and not n.names("http://e:1") and n.as_json(0)["state"] == "unsupported"
    n.set_workers([Engine("http://p:1", "prefill"), Engine("http://d:1", "decode", dp_ranks=2)])
    assert not n.supported and n.index("http://d:1", "/generate", 0.0) is None


def test_an_answer_from_another_worker_teaches_that_index():
    n = DecodeNaming()
    n.set_workers(_fleet(3))
    i = n.index("http://d:0", "/v1/completions", 0.0)
    assert n.answered("http://d:0", "/v1/completions", i, "http://d:2", 0.0) is None
    assert n.index("http://d:2", "/v1/completions", 0.0) == i  # smg's index i is d:2 on that route
    assert n.index("http://d:0", "/generate", 0.0) == 0  # other routes keep their own order
    assert n.answered("http://d:2", "/v1/completions", i, "http://d:2", 0.0) == NAMING
    assert (n.hits, n.relearned, n.contradicted) == (1, 1, 0)


def test_contradicting_answers_switch_naming_off_and_it_is_tried_again_later():
    n = DecodeNaming(max_misses=3, retry_s=60.0)
    n.set_workers(_fleet(3))
    seq = ["http://d:0", "http://d:1", "http://d:2", "http://d:0"]  # index 0 answered from three workers
    states = [n.answered("http://d:0", "/generate", 0, routed, 1.0) for routed in seq]
    assert states == [NAMING, None, None, OFF] and n.contradicted == 3
    assert n.index("http://d:0", "/generate", 60.9) is None
    assert n.index("http://d:0", "/generate", 61.0) == 0 and n.state == TRYING


def test_answers_to_calls_named_before_naming_went_off_leave_it_off():
    """Calls in flight when naming goes off come back later; a hit among them does not switch naming on."""
    n = DecodeNaming(max_misses=3, retry_s=60.0)
    n.set_workers(_fleet(3))
    for routed in ("http://d:0", "http://d:1", "http://d:2", "http://d:0"):
        n.answered("http://d:0", "/generate", 0, routed, 1.0)
    assert n.state == OFF
    assert n.answered("http://d:1", "/generate", 1, "http://d:1", 2.0) is None and n.state == OFF
    assert n.index("http://d:1", "/generate", 30.0) is None


def test_a_refusal_switches_naming_off_for_the_retry_time():
    n = DecodeNaming(retry_s=30.0)
    n.set_workers(_fleet(3))
    assert n.refused("http://d:2", "/generate", 5.0) == OFF
    assert n.as_json(10.0)["retry_in_s"] == 25.0
    assert all(n.index(f"http://d:{i}", "/generate", 34.0) is None for i in range(3))
    assert n.index("http://d:2", "/generate", 35.0) == 2


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 8), st.integers(0, 2**32 - 1), st.lists(st.tuples(st.integers(0, 2), st.integers(0, 7)),
                                                              min_size=1, max_size=120))
def test_a_fixed_order_is_learned_in_at_most_n_minus_one_misses_a_route_and_naming_never_goes_off(n_dec, seed,
                                                                                                  calls):
    """Whatever smg's hidden order per route (a fixed permutation of the decode workers), and whatever calls
    kvgate names in whatever order: each route misses at most n - 1 times, then every named call hits, and
    naming never goes off."""
    rng = random.Random(seed)
    workers = [f"http://d:{i}" for i in range(n_dec)]
    hidden = {r: rng.sample(workers, n_dec) for r in ROUTES}
    n = DecodeNaming()
    n.set_workers(_fleet(n_dec, ids=[f"{rng.random():.6f}" for _ in range(n_dec)]))
    misses = dict.fromkeys(ROUTES, 0)
    for t, (r, w) in enumerate(calls):
        route, url = ROUTES[r], workers[w % n_dec]
        i = n.index(url, route, float(t))
        assert i is not None
        routed = hidden[route][i]
        misses[route] += routed != url
        n.answered(url, route, i, routed, float(t))
        assert n.state != OFF
    assert all(m <= n_dec - 1 for m in misses.values()), misses
    assert n.contradicted == 0 and n.hits + n.relearned == len(calls)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 8), st.integers(0, 2**32 - 1))
def test_a_policy_that_ignores_the_name_switches_naming_off(n_dec, seed):
    """smg's decode policy reads no header (the worker is random per call): naming goes off within a bounded
    number of answers, and the decode worker is left to smg."""
    rng = random.Random(seed)
    workers = [f"http://d:{i}" for i in range(n_dec)]
    n = DecodeNaming(max_misses=3, window=16)
    n.set_workers(_fleet(n_dec))
    for t in range(2000):
        url = rng.choice(workers)
        i = n.index(url, "/generate", 0.0)
        if i is None:
            break
        n.answered(url, "/generate", i, rng.choice(workers), 0.0)
    assert n.state == OFF and n.contradicted >= 3
    for _ in range(50):  # answers still in flight: off stays off until the retry time
        url = rng.choice(workers)
        n.answered(url, "/generate", 0, url, 1.0)
        assert n.state == OFF and n.index(url, "/generate", 59.0) is None


def test_a_new_worker_list_starts_learning_again():
    n = DecodeNaming()
    n.set_workers(_fleet(3))
    n.answered("http://d:0", "/generate", 0, "http://d:1", 0.0)
    assert n.index("http://d:1", "/generate", 0.0) == 0
    n.set_workers(_fleet(4))
    assert [n.index(f"http://d:{i}", "/generate", 0.0) for i in range(4)] == [0, 1, 2, 3]
    assert n.names("http://d:3") and not n.names("http://p:0")
