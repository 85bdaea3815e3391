"""kvgate bench: one command that replays agentic sessions against KV-bound simulated engines and compares
kvgate's arms with the plain router, the router's own limiter and unbounded KV.

Pure: scenario.py (scenario file), speed.py (speed-factor scaling), workload.py (closed-loop sessions and the
Mooncake window), report.py (metrics, ratios, the table, the mean over seeds), ranking.py (intervals, the
seeds-as-blocks residual, Scott-Knott tiers, run-to-run comparison). Edge: runner.py (fleets, client, sampler),
plots.py, command.py (``kvgate bench``), sglang_fleet.py (real SGLang engines for ``engine: sglang``). trace.py
reads the Mooncake conversation trace (pure; the demo uses it too).

Turns go out the way RL rollouts send them: token ids to /generate by default (scenario key ``api``: ``chat``
for /v1/chat/completions message lists, ``completions`` for /v1/completions text). On /generate and chat the
lifecycle arms reach the engines' session KV through kvgate's session placement (session_placement: kvgate,
docs/placement.md); the report counts the session ids the engines saw.
The ids are the simulator's byte tokenization of the workload's text (``kvgate sim-engine --token-vocab byte``,
the default, generates only printable-ASCII byte tokens), so "previous prompt + output + observation" hits the
radix cache exactly as "previous input_ids + output_ids + observation ids" would. The ``proxy-placement`` arm
(kvgate placing sessions, both features off) and ``smg-manual`` (smg's routing-key policy) compare placement
alone against the scenario's smg policy (cache_aware by default): prefix hit, makespan, per-engine load spread.
``lifecycle+admission-2replicas`` runs ``lifecycle+admission`` on two kvgate replicas sharing state through a
redis-server of the arm's own (``state_backend: redis``, docs/replicas.md); the client's sessions are split
between them and every fourth one alternates its turns (runner.replica_for).
"""
