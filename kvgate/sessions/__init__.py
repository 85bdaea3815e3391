"""Sessions: which session a call belongs to and when, and how, a session is closed on the engines.

Owns session identity (identity: named by header or field), prefix-based inference for clients that name
none (inference), the registry of what kvgate knows of each session (registry), when a session counts as
ended (idle_policy), what a relayed response says about it (observe) and the /close_session fan-out to every
engine (lifecycle). Pure modules: identity, inference, registry, idle_policy, observe. May import
kvgate.common and kvgate.fleet.
"""
