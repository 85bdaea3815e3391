"""Reservation estimates (issue 3 "The behaviour"; SGLang srt/managers/io_struct.py max_new_tokens=128)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.admission.reservation import (
    CHAT_MESSAGE_OVERHEAD_TOKENS,
    MIN_PROMPT_TOKENS,
    SGLANG_DEFAULT_MAX_NEW_TOKENS,
    Estimator,
    estimate_reservation,
    estimate_text_tokens,
)

CAP = 4096


def est(path, body, cap=CAP, **kw):
    return estimate_reservation(path, body, expected_decode_cap=cap, **kw)


def test_input_ids_with_max_new_tokens():
    assert est("/generate", {"input_ids": list(range(1000)), "sampling_params": {"max_new_tokens": 512}}) == 1512


def test_default_max_new_tokens_is_128():
    assert SGLANG_DEFAULT_MAX_NEW_TOKENS == 128
    assert est("/generate", {"input_ids": [1] * 100}) == 228
    assert est("/generate", {"input_ids": [1] * 100, "sampling_params": {}}) == 228
    assert est("/generate", {"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": None}}) == 228


def test_completion_capped_by_expected_decode_cap():
    body = {"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 30_000}}
    assert est("/generate", body, cap=2048) == 2148
    assert est("/generate", {"input_ids": [1] * 100}, cap=64) == 164  # cap below the 128 default


def test_max_new_tokens_zero():
    assert est("/generate", {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 0}}) == 10


def test_batch_input_ids():
    body = {"input_ids": [[1] * 100, [1] * 200, [1] * 50], "sampling_params": {"max_new_tokens": 10}}
    assert est("/generate", body) == 110 + 210 + 60


def test_batch_per_item_sampling_params():
    body = {"input_ids": [[1] * 100, [1] * 200], "sampling_params": [{"max_new_tokens": 10}, {"max_new_tokens": 20, "n": 2}]}
    assert est("/generate", body) == 110 + 200 + 2 * 20  # n copies share their prompt


def test_generate_n_gt_1():
    body = {"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 50, "n": 4}}
    assert est("/generate", body) == 100 + 4 * 50  # SGLang prefills the prompt once for n copies


def test_generate_text_estimate():
    body = {"text": "a" * 300, "sampling_params": {"max_new_tokens": 10}}
    assert est("/generate", body) == 100 + 10  # 300 chars / 3.0
    assert est("/generate", {"text": "a" * 301, "sampling_params": {"max_new_tokens": 10}}) == 101 + 10  # ceil
    assert est("/generate", body, chars_per_token=4.0) == 75 + 10


def test_generate_text_batch():
    assert est("/generate", {"text": ["a" * 30, "b" * 60]}) == (10 + 128) + (20 + 128)


def test_tokenizer_callable_used():
    calls = []

    def tok(s):
        calls.append(s)
        return len(s.split())

    body = {"text": "one two three four", "sampling_params": {"max_new_tokens": 6}}
    assert est("/generate", body, tokenizer=tok) == 4 + 6
    assert calls == ["one two three four"]


def test_tokenizer_failure_falls_back_to_ratio():
    def bad(_):
        raise RuntimeError("boom")

    assert estimate_text_tokens("a" * 90, tokenizer=bad) == 30


def test_openai_completions():
    assert est("/v1/completions", {"prompt": "x" * 90, "max_tokens": 100}) == 130
    assert est("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 7}) == 10
    assert est("/v1/completions", {"prompt": ["x" * 30, "y" * 30], "max_tokens": 5, "n": 2}) == 2 * 10 + 4 * 5
    assert est("/v1/completions", {"prompt": [[1] * 10, [1] * 20], "max_tokens": 5}) == 15 + 25
    assert est("/v1/completions?foo=1", {"prompt": "x" * 90}) == 30 + CAP  # OpenAI routes run to the context


def test_chat_messages_string_and_parts():
    body = {
        "messages": [
            {"role": "system", "content": "s" * 30},
            {"role": "user", "content": [{"type": "text", "text": "u" * 60}, {"type": "image_url", "image_url": {"url": "data:"}}]},
        ],
        "max_tokens": 100,
    }
    expected = (10 + CHAT_MESSAGE_OVERHEAD_TOKENS) + (20 + CHAT_MESSAGE_OVERHEAD_TOKENS) + 100
    assert est("/v1/chat/completions", body) == expected


def test_chat_max_completion_tokens_preferred_and_n():
    body = {"messages": [{"role": "user", "content": "u" * 30}], "max_tokens": 999, "max_completion_tokens": 50, "n": 3}
    assert est("/v1/chat/completions", body) == 10 + CHAT_MESSAGE_OVERHEAD_TOKENS + 3 * 50


def test_chat_tool_calls_counted():
    body = {
        "messages": [
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f" * 3, "arguments": "a" * 27}}]},
        ],
        "max_tokens": 1,
    }
    assert est("/v1/chat/completions", body) == 10 + CHAT_MESSAGE_OVERHEAD_TOKENS + 1


def test_responses_api():
    body = {"input": "i" * 30, "instructions": "x" * 30, "max_output_tokens": 20}
    assert est("/v1/responses", body) == 10 + 10 + CHAT_MESSAGE_OVERHEAD_TOKENS + 20
    body2 = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "t" * 60}]}]}
    assert est("/v1/responses", body2) == 20 + CHAT_MESSAGE_OVERHEAD_TOKENS + CAP


@pytest.mark.parametrize(
    "path,body",
    [
        ("/generate", None),
        ("/generate", "garbage"),
        ("/generate", []),
        ("/generate", {}),
        ("/generate", {"input_ids": "abc", "sampling_params": "x"}),
        ("/generate", {"sampling_params": {"max_new_tokens": "many", "n": -3}}),
        ("/v1/chat/completions", {"messages": "hi"}),
        ("/v1/chat/completions", {"messages": [None, 3]}),
        ("/v1/completions", {"prompt": {"a": 1}, "max_tokens": -5}),
        ("/v1/completions", {"prompt": [True, None]}),
        ("/weird", {"foo": object()}),
    ],
)
def test_odd_bodies_never_raise_and_reserve_minimum(path, body):
    n = est(path, body)
    assert n >= MIN_PROMPT_TOKENS + 1
    # the OpenAI routes' budget without max_tokens is the decode cap (they run to the context length)
    budget = 128 if path == "/generate" else CAP
    assert n <= 2 * (MIN_PROMPT_TOKENS + budget) + 2 * CHAT_MESSAGE_OVERHEAD_TOKENS


def test_odd_body_exact_minimum():
    assert est("/generate", None) == MIN_PROMPT_TOKENS + 128
    assert est("/generate", {}, cap=16) == MIN_PROMPT_TOKENS + 16


def test_bad_config_raises():
    with pytest.raises(ValueError):
        estimate_reservation("/generate", {}, expected_decode_cap=0)
    with pytest.raises(ValueError):
        estimate_reservation("/generate", {}, expected_decode_cap=10, chars_per_token=0)


def test_conservative_ratio_overestimates_english():
    text = "The quick brown fox jumps over the lazy dog. " * 20
    # ~4 chars/token in English BPE -> the 3.0 ratio reserves ~33% more
    assert estimate_text_tokens(text) == math.ceil(len(text) / 3.0)
    assert estimate_text_tokens(text) > len(text) / 4.0


_sampling_value = st.one_of(st.none(), st.integers(-5, 10**6), st.floats(allow_nan=True), st.booleans(),
                            st.text(max_size=3))


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.lists(st.integers(0, 2**40), max_size=200), st.lists(st.one_of(st.integers(), st.booleans(),
                                                                                   st.text(max_size=2)), max_size=4)),
       st.one_of(st.none(), st.just({}), st.dictionaries(st.sampled_from(["n", "max_new_tokens", "temperature"]),
                                                        _sampling_value, max_size=3)),
       st.integers(1, 8192), st.sampled_from([0, 4, 64]))
def test_the_direct_read_of_a_token_id_prompt_matches_the_general_rules(ids, sp, cap, block):
    """The Estimator reads a /generate body with a flat token-id prompt directly (the per-request fast path):
    for every such body, odd ones included, its Reservation (tokens, prompt, sequences, prefix blocks) is the
    one the general rules give."""
    body = {"input_ids": ids} if sp is None else {"input_ids": ids, "sampling_params": sp}
    e = Estimator(expected_decode_cap=cap, block_tokens=block)
    assert e("/generate", body) == e.general("/generate", body)
