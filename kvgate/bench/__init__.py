"""kvgate bench: one command that replays agentic sessions against KV-bound simulated engines and compares
kvgate's arms with the plain router, the router's own limiter and unbounded KV (issue 4).

Pure: scenario.py (scenario file), speed.py (speed-factor scaling), workload.py (closed-loop sessions and the
Mooncake window), report.py (metrics, ratios, the table). Edge: runner.py (fleets, client, sampler), plots.py,
cli.py.
"""
