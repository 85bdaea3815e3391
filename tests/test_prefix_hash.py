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
        assert h.grand_total() == sum(total(p) for p in (None, "e0", "e1"))  # kept running, after every op


@settings(max_examples=200, deadline=None)
@given(st.one_of(_ids, _big_ids), st.integers(1, 4))
def test_placement_keys_of_an_id_list_are_the_chain_inference_indexes(ids, block):
    """Placement hashes an id list as it is (first and last items checked), not copied and checked item by
    item: for every id list its keys are the chain inference indexes over the checked copy."""
    from kvgate.sessions.inference import _SEED, TOKENS, _chain, _normalize
    norm = _normalize(ids)
    want = [] if norm is None else _chain(norm[0], block, _SEED[TOKENS], 0, len(ids) // block)[1:]
    assert prefix_keys(ids, block, block) == prefix_keys(tuple(ids), block, block) == want


def test_placement_keys_of_odd_lists():
    assert prefix_keys([], 2, 2) == [] and prefix_keys(["a", 1], 2, 2) == [] and prefix_keys([1, 2.5], 2, 2) == []
    assert prefix_keys([True, 1], 2, 2) == []          # a bool is not a token id
    assert prefix_keys([1, [2], 3, 4], 2, 2) == []     # unhashable inside: no fingerprint, no exception
    assert len(prefix_keys([1, "x", 3, 4], 2, 2)) == 2  # odd values inside: keys all the same (SGLang refuses it)


def test_one_request_hashes_its_prompt_once_for_admission_and_placement(monkeypatch):
    """Admission's prefix blocks and placement's prefix keys chain the same block hashes from different
    starts: with the request's BlockDigests the prompt is hashed once, and the keys are those computed alone.
    Another prompt, or the same request's body parsed again after a wait, is hashed anew."""
    import orjson

    from kvgate.admission.reservation import estimate_request
    from kvgate.common import prefix_hash
    from kvgate.common.classify import classify

    calls = []
    real = prefix_hash._digests
    monkeypatch.setattr(prefix_hash, "_digests", lambda *a: calls.append(a[1:]) or real(*a))
    raw = orjson.dumps({"input_ids": list(range(1000)), "sampling_params": {"max_new_tokens": 8}})
    c = classify("POST", "/generate", raw)
    res = estimate_request(c.path, c.body, expected_decode_cap=64, block_tokens=64, memo=c.block_digests())
    keys = prefix_keys(c.body["input_ids"], 64, 256, memo=c.block_digests())
    assert len(calls) == 1 and len(res.blocks) == len(keys) == 15
    alone = (estimate_request(c.path, c.body, expected_decode_cap=64, block_tokens=64).blocks,
             prefix_keys(c.body["input_ids"], 64, 256))
    assert (res.blocks, keys) == alone and len(calls) == 3
    assert prefix_keys(list(range(1000)), 64, 256, memo=c.block_digests()) == keys and len(calls) == 4  # another list
    c.release_body()  # a waiter drops its parsed body, and the hashes that hold it
    assert prefix_keys(c.body["input_ids"], 64, 256, memo=c.block_digests()) == keys and len(calls) == 5
    memo = prefix_hash.BlockDigests()  # fewer blocks of the same prompt: read from the longer run
    ids = list(range(1000))
    full = prefix_hash.chain(ids, 64, 7, 0, None, memo)
    assert prefix_hash.chain(ids, 64, 7, 0, 5, memo) == full[:6] and len(calls) == 6
