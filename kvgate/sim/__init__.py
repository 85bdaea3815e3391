"""SGLang engine simulator (``kvgate sim-engine``): the GPU engine is the one thing kvgate's tests simulate.

Pure core: radix (the radix cache over a fixed KV pool, sessions, the HiCache host tier), scheduler (waiting
queue, PrefillAdder admission, continuous batching, retraction, sampling, compute model), exposition (SGLang's
Prometheus text), tokenizer. Which SGLang rule each follows: docs/simulator-fidelity.md. Edges:
sim_engine (async shell, DP ranks), http_api (SGLang's HTTP surface), args (the command line). Imports nothing
of kvgate outside kvgate.sim.
"""
