"""kvgate bench: one command that replays agentic sessions against KV-bound simulated engines and compares
kvgate's arms with the plain router, the router's own limiter and unbounded KV.

Pure: scenario.py (scenario file), speed.py (speed-factor scaling), workload.py (closed-loop sessions and the
Mooncake window), report.py (metrics, ratios, the table, the mean over seeds), ranking.py (intervals, the
seeds-as-blocks residual, Scott-Knott tiers, run-to-run comparison). Edge: runner.py (fleets, client, sampler), plots.py,
command.py (``kvgate bench``). trace.py reads the Mooncake conversation trace (pure; the demo uses it too).

Why turns go over /v1/completions as text and not /generate with input_ids: smg 1.13.0 and sglang-router 0.3.2
drop a top-level ``session_id`` on /generate and /v1/chat/completions and forward it only on /v1/completions,
whose smg handler accepts text prompts only (token-id prompts are a 422). Behind today's router kvgate's
session lifecycle can only reach the engines on that route, so every arm sends the same text requests there.
To keep the cache behaviour faithful to an input_ids client, the simulator's default byte-level model
(``kvgate sim-engine --token-vocab byte``) generates only printable-ASCII byte tokens: the output text
re-tokenizes to exactly the output ids, so "previous prompt + output text + observation" hits the radix cache
as "previous input_ids + output_ids + observation ids" would.
"""
