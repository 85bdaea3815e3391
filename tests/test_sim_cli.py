"""The simulator's command line: compute profiles and per-constant overrides (pure)."""

import argparse

import pytest

from kvgate.sim import args as cli
from kvgate.sim.scheduler import COMPUTE_PROFILES


def _opts(*argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.options_from_args(p.parse_args(list(argv)))


def test_default_profile_is_llama_3_8b_on_one_h100():
    o = _opts()
    assert (o["prefill_tokens_per_s"], o["decode_base_ms"], o["decode_per_seq_ms"],
            o["decode_per_ctx_token_us"]) == COMPUTE_PROFILES["llama-3-8b-h100"] == (20000.0, 6.0, 0.03, 0.05)


def test_a_profile_and_a_single_override():
    o = _opts("--compute-profile", "qwen2.5-32b-h100", "--decode-base-ms", "30")
    assert (o["prefill_tokens_per_s"], o["decode_base_ms"], o["decode_per_seq_ms"],
            o["decode_per_ctx_token_us"]) == (5400.0, 30.0, 0.06, 0.1)


def test_unknown_profile_is_refused():
    with pytest.raises(SystemExit):
        _opts("--compute-profile", "gpt-9")
