"""Command line for the simulated SGLang engine (the lead wires ``kvgate sim-engine`` here).

``add_arguments(parser)`` registers the flags; ``run(args) -> int`` serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys

from kvgate.sim.radix import SessionConfigError
from kvgate.sim.radix import HICACHE_WRITE_POLICIES
from kvgate.sim.scheduler import (COMPUTE_PROFILES, DEFAULT_H2D_BYTES_PER_S, NEW_TOKEN_RATIO_SEMANTICS, PROFILE_CONTEXT,
                                  PROFILE_OPTIONS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the simulator flags on ``parser``."""
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    a("--port", type=int, default=30000, help="TCP port to listen on (default: %(default)s, SGLang's)")
    a("--max-total-num-tokens", type=int, default=200000, help="KV pool size per DP rank (tokens)")
    a("--session-semantics", choices=("0.5.17", "0.5.15"), default="0.5.17",
      help="session radix cache close semantics (and reported version)")
    a("--enable-session-radix-cache", dest="enable_session_radix_cache",
      action=argparse.BooleanOptionalAction, default=True,
      help="SGLang's session radix cache: requests with a session_id tag the KV they cache and /close_session "
           "releases it, as --session-semantics says (on by default here, off by default in SGLang)")
    a("--radix-eviction-policy", choices=("lru", "priority"), default="lru",
      help="priority: evict by (max priority of the requests that touched a node, last access)")
    a("--speed", type=float, default=1.0, help="simulated time runs this many times faster")
    a("--compute-profile", choices=sorted(COMPUTE_PROFILES), default="llama-3-8b-h100",
      help="the model and device the simulated compute times stand for: the two H100 profiles are derived from "
           "FLOPs and memory bandwidth, sglang-cpu-mlp is fitted to a real CPU engine (docs/simulator.md, "
           "docs/simulator-fidelity.md); the four flags below override single constants of the profile")
    a("--prefill-tokens-per-s", type=float, default=None,
      help="prefill throughput, tokens per second at --speed 1 (default: the profile's)")
    a("--decode-base-ms", type=float, default=None,
      help="fixed time of one decode step, milliseconds (default: the profile's)")
    a("--decode-per-seq-ms", type=float, default=None,
      help="extra decode-step time per running request, milliseconds (default: the profile's)")
    a("--decode-per-ctx-token-us", type=float, default=None,
      help="extra decode-step time per token of context attended, microseconds (default: the profile's)")
    a("--prefill-base-ms", type=float, default=None,
      help="fixed time of every prefill batch on top of its tokens, milliseconds (default: the profile's; "
           "0 for the H100 profiles)")
    a("--compute-scale", type=float, default=1.0,
      help="multiply every prefill and decode time by this (a host slower than the profile's; default 1)")
    a("--host-board", default=None, metavar="DIR",
      help="engines started with the same directory share this host's cores: while others compute, a batch "
           "takes longer by the two --host-contention figures (default: none, every engine has a host of its own)")
    a("--host-contention-prefill", type=float, default=0.0,
      help="extra fraction of a prefill batch's time per other engine computing on the board (default 0)")
    a("--host-contention-decode", type=float, default=0.0,
      help="extra fraction of a decode step's time per other engine computing on the board (default 0)")
    a("--max-running-requests", type=int, default=1024,
      help="most requests decoding at once per DP rank; more wait for a later batch (default: %(default)s)")
    a("--chunked-prefill-size", type=int, default=8192,
      help="longest prefill chunk, tokens: longer prompts are prefilled in several rounds (default: %(default)s)")
    a("--max-prefill-tokens", type=int, default=16384,
      help="most prompt tokens one prefill batch takes in (default: %(default)s)")
    a("--eos-rate", type=float, default=0.0,
      help="per-token probability of a deterministic EOS (ignored with ignore_eos)")
    a("--token-vocab", choices=("byte", "wide"), default="byte",
      help="generated ids: byte = printable ASCII byte tokens whose text re-tokenizes to the same ids "
           "(multi-turn text prompts reuse the cache); wide = ids in [3, 32000) rendered as words")
    a("--new-token-ratio-semantics", choices=NEW_TOKEN_RATIO_SEMANTICS, default="0.5.17",
      help="0.5.17: new_token_ratio discounts every running request's reserved decode tokens; 0.5.23: requests "
           "with ignore_eos reserve all of theirs")
    a("--enable-priority-scheduling", action="store_true",
      help="order the waiting queue by request priority (higher first), then arrival")
    a("--random-seed", type=int, default=None,
      help="seed of the sampling draws of requests with temperature > 0 and no sampling_seed (default: random)")
    a("--enable-hierarchical-cache", action="store_true",
      help="HiCache: keep KV in a host-memory tier and load it back instead of recomputing")
    a("--hicache-ratio", type=float, default=2.0, help="host tier size as a multiple of the KV pool")
    a("--hicache-size", type=float, default=0.0, help="host tier size in GB per DP rank (overrides the ratio)")
    a("--hicache-write-policy", choices=HICACHE_WRITE_POLICIES, default="write_through",
      help="when KV is copied to the host tier: as soon as it is cached (write_through), once a prefix was "
           "cached twice (write_through_selective), or only when the GPU pool evicts it (write_back)")
    a("--hicache-h2d-gbps", type=float, default=DEFAULT_H2D_BYTES_PER_S / 1e9,
      help="host-to-device copy bandwidth for HiCache load-back (GB/s)")
    a("--tp-copies", type=int, default=1,
      help="emit identical metric copies for tp_rank 0..N-1")
    a("--dp-size", type=int, default=1,
      help="data-parallel ranks, each with its own KV pool and radix cache; requests are spread round robin "
           "unless routed_dp_rank pins one (default: %(default)s)")
    a("--disable-metrics", action="store_true", help="/metrics answers 404")
    a("--disaggregation-mode", choices=("null", "prefill", "decode"), default="null",
      help="SGLang's prefill/decode disaggregation role: a prefill worker ends each request after its first token "
           "and serves the KV on its bootstrap port; a decode worker waits for each request's bootstrap_room, "
           "receives the KV and decodes (docs/simulator.md; default: %(default)s, a regular engine)")
    a("--disaggregation-bootstrap-port", type=int, default=8998,
      help="a prefill worker's bootstrap server port, the one smg is given after its URL (--prefill URL PORT) "
           "(default: %(default)s, SGLang's)")
    a("--disaggregation-transfer-backend", default="mooncake",
      help="accepted for SGLang's command line; the simulator models one transfer (--sim-transfer-us-per-token)")
    a("--disaggregation-decode-enable-radix-cache", action="store_true",
      help="a decode worker keeps a radix cache (a session's prefix stays on it between turns); the simulator's "
           "decode worker always does, so decode mode requires this flag")
    a("--sim-transfer-us-per-token", type=float, default=5.0,
      help="simulated microseconds to move one token's KV from the prefill to the decode worker (default: "
           "%(default)s, about 128 KiB a token over 25 GB/s)")
    a("--model-name", default="kvgate-sim",
      help="model name reported by /v1/models, /server_info and the metrics labels (default: %(default)s)")


def options_from_args(args: argparse.Namespace) -> dict:
    """Keyword options for ``start_sim_engine`` from parsed args: the compute profile's constants unless a flag
    sets one."""
    prefill, base, per_seq, per_ctx = COMPUTE_PROFILES[args.compute_profile]
    attn_flops, weight_flops, forward_min_ms, kv_bytes = PROFILE_CONTEXT[args.compute_profile]
    pick = lambda v, d: d if v is None else v  # noqa: E731
    profile = dict(PROFILE_OPTIONS.get(args.compute_profile, {}))
    if args.prefill_base_ms is not None:
        profile["prefill_base_ms"] = args.prefill_base_ms
    return dict(
        max_total_num_tokens=args.max_total_num_tokens,
        session_semantics=args.session_semantics,
        enable_session_radix_cache=args.enable_session_radix_cache,
        radix_eviction_policy=args.radix_eviction_policy, speed=args.speed,
        prefill_tokens_per_s=pick(args.prefill_tokens_per_s, prefill),
        decode_base_ms=pick(args.decode_base_ms, base),
        decode_per_seq_ms=pick(args.decode_per_seq_ms, per_seq),
        decode_per_ctx_token_us=pick(args.decode_per_ctx_token_us, per_ctx), compute_scale=args.compute_scale,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens, eos_rate=args.eos_rate,
        token_vocab=args.token_vocab,
        prefill_attn_flops_per_ctx_token=attn_flops, prefill_weight_flops_per_token=weight_flops,
        forward_min_ms=forward_min_ms, kv_bytes_per_token=kv_bytes,
        hicache_h2d_bytes_per_s=args.hicache_h2d_gbps * 1e9,
        **profile,
        new_token_ratio_semantics=args.new_token_ratio_semantics,
        enable_priority_scheduling=args.enable_priority_scheduling, random_seed=args.random_seed,
        enable_hierarchical_cache=args.enable_hierarchical_cache, hicache_ratio=args.hicache_ratio,
        hicache_size=args.hicache_size, hicache_write_policy=args.hicache_write_policy,
        host_board=args.host_board, host_contention_prefill=args.host_contention_prefill,
        host_contention_decode=args.host_contention_decode,
        tp_copies=args.tp_copies, dp_size=args.dp_size, disable_metrics=args.disable_metrics,
        model_name=args.model_name, disaggregation_mode=args.disaggregation_mode,
        disaggregation_bootstrap_port=args.disaggregation_bootstrap_port,
        disaggregation_transfer_us_per_token=args.sim_transfer_us_per_token)


async def _serve(args: argparse.Namespace) -> int:
    from kvgate.sim.http_api import start_sim_engine
    try:
        handle = await start_sim_engine(args.host, args.port, **options_from_args(args))
    except SessionConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the port or the bootstrap port is taken
        print(f"error: cannot listen: {e}", file=sys.stderr)
        return 2
    role = "" if args.disaggregation_mode == "null" else (
        f" as a {args.disaggregation_mode} worker" + (f" (bootstrap port {args.disaggregation_bootstrap_port})"
                                                      if args.disaggregation_mode == "prefill" else ""))
    board = (f" (host board {args.host_board}: contention prefill {args.host_contention_prefill:g}, decode "
             f"{args.host_contention_decode:g})" if args.host_board else "")
    print(f"kvgate sim-engine serving on {handle.url}{role}{board}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await handle.close()
    return 0


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code (2 on a startup configuration error)."""
    for name in ("host_contention_prefill", "host_contention_decode"):
        flag, v = "--" + name.replace("_", "-"), getattr(args, name)
        if not (math.isfinite(v) and v >= 0):
            print(f"error: {flag} must be a number >= 0, got {v}", file=sys.stderr)
            return 2
        if v > 0 and not args.host_board:
            print(f"error: {flag} needs --host-board DIR (the engines that share the host)", file=sys.stderr)
            return 2
    if args.host_board:
        from kvgate.sim.host import HostBoard
        try:  # a slot taken and given back: the directory is usable before the server starts
            HostBoard(args.host_board).close()
        except (OSError, RuntimeError) as e:
            print(f"error: --host-board {args.host_board}: {e}", file=sys.stderr)
            return 2
    if args.disaggregation_mode == "decode" and not args.disaggregation_decode_enable_radix_cache:
        print("error: --disaggregation-mode decode needs --disaggregation-decode-enable-radix-cache (the "
              "simulator's decode worker always keeps a radix cache)", file=sys.stderr)
        return 2
    if not (math.isfinite(args.sim_transfer_us_per_token) and args.sim_transfer_us_per_token >= 0):
        print(f"error: --sim-transfer-us-per-token must be a number >= 0, got {args.sim_transfer_us_per_token}",
              file=sys.stderr)
        return 2
    if args.session_semantics == "0.5.15" and args.enable_session_radix_cache \
            and args.radix_eviction_policy != "priority":
        print("error: --enable-session-radix-cache requires --radix-eviction-policy priority",
              file=sys.stderr)
        return 2
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    return asyncio.run(_serve(args))


def main(argv=None) -> int:
    """Standalone entry: ``python -m kvgate.sim.args``."""
    p = argparse.ArgumentParser(prog="kvgate sim-engine")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
