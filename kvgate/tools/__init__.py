"""Operator tools around kvgate: ``kvgate demo``, ``kvgate engine`` (engine_command: real SGLang CPU engines by
hand), the one launcher of real SGLang engines (sglang_engine), the Grafana dashboard builder and the subprocess
helpers (procs) that the demo, the bench and the tests use to start routers, simulated engines and kvgate.

May import anything in kvgate; nothing in the request path imports it.
"""
