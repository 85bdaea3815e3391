"""The HTTP request path: classify a request, resolve its session, admit it, relay it, record the outcome.

Owns the gateway (app) and kvgate's own HTTP/1.1 server for its clients (server; aiohttp's web server is kept
behind ``http_server: aiohttp``), request classification (classify), the admission seam (admit), the byte
relay to the router or an engine (relay, over the pooled HTTP/1.1 client in pool) and kvgate's own Prometheus
series (metrics). May import kvgate.config, kvgate.common, kvgate.sessions, kvgate.admission and kvgate.fleet;
nothing imports it back except the CLI (and sessions/admission read the pure route constants in classify).
"""
