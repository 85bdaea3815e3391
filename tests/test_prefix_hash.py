"""Chained prompt-block hashes (kvgate.common.prefix_hash) and their users: admission's prefix blocks,
placement's and inference's prefix keys, the replicas' fingerprints, and the working-set holdings."""

import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.admission.reservation import prefix_blocks
from kvgate.admission.working_set import Holdings
from kvgate.common.prefix_hash import is_token_ids, stable_chain
from kvgate.sessions.inference import prefix_keys
from kvgate.shared import fingerprint

# Small alphabets so that two prompts often share a prefix of several blocks and then part ways.
_ids = st.lists(st.integers(0, 2), max_size=40)
_big_ids = st.lists(st.sampled_from([0, 1, 2**31 - 1, 2**40 + 7, 151_000]), max_size=40)
_text = st.text(alphabet="ab\u00e9\U0001F600", max_size=40)


def _agree(keys_a, keys_b, a, b, block):
    """Key k of a equals key k of b exactly when a and b agree on their first k + 1 blocks."""
    for k in range(min(len(keys_a), len(keys_b))):
        same_prefix = a[:(k + 1) * block] == b[:(k + 1) * block]
        assert (keys_a[k] == keys_b[k]) == same_prefix, (k, a, b)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.tuples(_ids, _ids), st.tuples(_big_ids, _big_ids), st.tuples(_text, _text)),
       st.integers(1, 4))
def test_equal_keys_exactly_when_the_prefixes_are_equal_blockwise(pair, block):
    a, b = pair
    text = isinstance(a, str)
    pa = a if text else list(a)
    pb = b if text else list(b)
    cpt = 1.0  # text: a block is block_tokens x chars_per_token characters
    _agree(prefix_blocks(pa, block, cpt), prefix_blocks(pb, block, cpt), a, b, block)
    _agree(prefix_keys(pa, block, block), prefix_keys(pb, block, block), a, b, block)
    _agree(fingerprint.chain(pa, block), fingerprint.chain(pb, block), a, b, block)
    n = len(a) // block
    assert len(prefix_blocks(pa, block, cpt)) == len(prefix_keys(pa, block, block)) == n
    assert len(fingerprint.chain(pa, block)) == n


def test_token_ids_and_text_never_share_keys():
    assert not set(prefix_blocks([97] * 8, 4)) & set(prefix_blocks("a" * 8, 4, 1.0))
    assert not set(fingerprint.chain([97] * 8, 4)) & set(fingerprint.chain("a" * 8, 4))


def test_stable_keys_are_pinned_and_the_same_in_another_process():
    """Replicas compare these keys through Redis: they must not move with the process (hash randomisation)
    or silently with the Python version (the pinned values)."""
    ids_keys = ["507853a4be4f8ef6015df91f750fbac3", "46c3fdf4c68e1f06cd7380122671e04e"]
    text_keys = ["6c0fb18148ba92a178caccc564d7bd8c", "39b418929a4d4c7759783bfd84e736e7"]
    assert fingerprint.chain(list(range(1, 129)), 64) == ids_keys
    assert fingerprint.chain("kvgate " * 20, 64) == text_keys
    code = ("from kvgate.shared import fingerprint as f; "
            "print(f.chain(list(range(1, 129)), 64) + f.chain('kvgate ' * 20, 64))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert eval(out) == ids_keys + text_keys  # noqa: S307 - our own child's repr of a list of str


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(-2**70, 2**70), st.booleans(), st.floats(allow_nan=False),
                          st.none(), st.text(max_size=2), st.lists(st.integers(), max_size=2)), max_size=8))
def test_token_id_check_matches_the_python_rule(items):
    want = all(type(x) is int and -2**63 <= x < 2**64 for x in items)
    assert is_token_ids(items) is want
    assert is_token_ids(tuple(items)) is want


def test_stable_chain_rejects_what_is_not_ids_or_text():
    for bad in ([1, 2.0, 3], [1, True], [[1]], [2**80]):
        try:
            stable_chain(bad * 64, 4)
        except TypeError:
            continue
        raise AssertionError(f"{bad!r} was accepted")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.sampled_from([None, "e0", "e1"]),
                          st.lists(st.integers(0, 6), max_size=6), st.integers(0, 50)), max_size=40))
def test_holdings_count_each_block_once_per_place(ops):
    """Holdings (set and map operations) against the plain rule: a place holds its holders' distinct
    blocks x block_tokens plus their tails; add returns what it added, remove what it freed."""
    h = Holdings(block_tokens=10)
    model: dict[int, tuple] = {}  # holder -> (place, set of blocks, tail)

    def total(place, extra=()):
        held = [m for m in model.values() if m[0] == place] + list(extra)
        return len(set().union(*(m[1] for m in held))) * 10 + sum(m[2] for m in held)

    for is_add, holder, place, blocks, tail in ops:
        if is_add:
            new = (place, set(blocks), tail)
            assert h.cost(place, blocks, tail) == total(place, [new]) - total(place)
            model.pop(holder, None)  # add replaces the holder's holding
            before = total(place)
            model[holder] = new
            assert h.add(holder, place, blocks + blocks[:1], tail) == total(place) - before  # repeats count once
        else:
            m = model.pop(holder, None)
            want = 0 if m is None else total(m[0], [m]) - total(m[0])
            assert h.remove(holder) == want
        for p in (None, "e0", "e1"):
            assert h.total(p) == total(p)
    assert h.grand_total() == sum(total(p) for p in (None, "e0", "e1"))
