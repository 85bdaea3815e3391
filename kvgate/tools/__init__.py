"""Operator tools around kvgate: ``kvgate demo``, the Grafana dashboard builder and the subprocess helpers
(procs) that the demo, the bench and the tests use to start routers, simulated engines and kvgate.

May import anything in kvgate; nothing in the request path imports it.
"""
