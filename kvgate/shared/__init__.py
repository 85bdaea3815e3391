"""State shared by kvgate replicas (``state_backend: redis``).

fingerprint: stable prompt fingerprints (the same on every replica, unlike Python's hash of text);
batch: the pure core of the Redis write batch (which calls go together, merged, in what order; what falls
back when Redis fails a batch);
scripts: the Lua scripts that take the replicas' atomic decisions inside Redis (idle close, lease grants,
the shared wait queue, the capacity poll's lease);
redis_state: the Redis edge. It moves data in and out of the pure cores (the session registry,
placement, session inference, the admission ledger's leases and wait queue, the capacity snapshot) and
fails open: while Redis is unreachable each replica decides on
its own state, as with ``state_backend: memory``.
"""
