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


def test_profiles_carry_their_context_constants_and_the_new_flags_parse():
    o = _opts("--compute-profile", "qwen2.5-32b-h100", "--enable-hierarchical-cache", "--hicache-size", "25",
              "--hicache-write-policy", "write_back", "--hicache-h2d-gbps", "25", "--enable-priority-scheduling",
              "--new-token-ratio-semantics", "0.5.23", "--random-seed", "3")
    assert (o["prefill_attn_flops_per_ctx_token"], o["prefill_weight_flops_per_token"], o["forward_min_ms"],
            o["kv_bytes_per_token"]) == (4 * 64 * 40 * 128, 65e9, 21.8, 2 * 64 * 8 * 128 * 2)
    assert (o["enable_hierarchical_cache"], o["hicache_size"], o["hicache_write_policy"], o["hicache_ratio"],
            o["hicache_h2d_bytes_per_s"]) == (True, 25.0, "write_back", 2.0, 25e9)
    assert (o["enable_priority_scheduling"], o["new_token_ratio_semantics"], o["random_seed"]) == (True, "0.5.23", 3)
    from kvgate.sim.http_api import build_options
    opts = build_options(**o)
    # --hicache-size is GB per rank: 25e9 / 256 KiB per token
    assert opts.host_pool_tokens() == 95367
    assert build_options(**_opts("--enable-hierarchical-cache")).host_pool_tokens() == 400000
    assert build_options(**_opts()).host_pool_tokens() == 0


def test_every_flag_has_help_for_users_without_source_paths():
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    flags = [a for a in p._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 29
    missing = [a.option_strings[0] for a in flags if not (a.help or "").strip()]
    assert missing == []
    # help speaks to users: no internal file paths such as "kvgate/sim/scheduler.py"
    with_paths = [a.option_strings[0] for a in flags if ".py" in a.help or "kvgate/" in a.help]
    assert with_paths == []


def test_the_prefill_base_and_the_host_board_flags():
    o = _opts("--compute-profile", "sglang-cpu-mlp")
    assert o["prefill_base_ms"] == 59.5 and o["prefill_attention_whole_context"] is True
    o = _opts("--compute-profile", "sglang-cpu-mlp", "--prefill-base-ms", "12.7")
    assert o["prefill_base_ms"] == 12.7 and o["prefill_attention_whole_context"] is True
    assert "prefill_base_ms" not in _opts()            # the H100 profiles have none
    assert _opts("--prefill-base-ms", "5")["prefill_base_ms"] == 5.0
    o = _opts("--host-board", "/tmp/b", "--host-contention-prefill", "0.2", "--host-contention-decode", "0.4")
    assert (o["host_board"], o["host_contention_prefill"], o["host_contention_decode"]) == ("/tmp/b", 0.2, 0.4)
    assert _opts()["host_board"] is None


def test_a_bad_host_contention_stops_startup_naming_the_flag(capsys):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    for argv, expect in [(["--host-contention-decode", "-1"], "--host-contention-decode must be a number >= 0"),
                         (["--host-board", "/tmp/x", "--host-contention-prefill", "nan"], "must be a number >= 0"),
                         (["--host-board", "/tmp/x", "--host-contention-decode", "inf"], "must be a number >= 0"),
                         (["--host-contention-prefill", "0.2"], "--host-contention-prefill needs --host-board DIR")]:
        assert cli.run(p.parse_args(argv)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expect in err, err


def test_a_host_board_that_is_not_a_usable_directory_stops_startup_in_one_line(tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("x")
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args(["--host-board", str(f)])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: --host-board {f}: ") and "File exists" in err
