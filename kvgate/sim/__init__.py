"""SGLang engine simulator (``kvgate sim-engine``): the GPU engine is the one thing kvgate's tests simulate.

Pure core: radix (the radix cache over a fixed KV pool), scheduler (waiting queue, PrefillAdder admission,
continuous batching, retraction, compute model), exposition (SGLang's Prometheus text), tokenizer. Edges:
engine (async shell, DP ranks), http_api (SGLang's HTTP surface), args (the command line). Imports nothing
of kvgate outside kvgate.sim.
"""
