"""The HTTP request path: classify a request, resolve its session, admit it, relay it, record the outcome.

Owns the aiohttp application (app), request classification (classify), the admission seam (admit), the byte
relay to the router or an engine (relay, over the pooled HTTP/1.1 client in pool) and kvgate's own Prometheus
series (metrics). May import kvgate.config, kvgate.common, kvgate.sessions, kvgate.admission and kvgate.fleet;
nothing imports it back except the CLI (and sessions/admission read the pure route constants in classify).
"""
