"""The HTTP request path: classify a request, resolve its session, admit it, relay it, record the outcome.

Owns the gateway (app: the wiring and the request path's stages), kvgate's own endpoints and the admin key
(admin), starting and serving (bootstrap), kvgate's own HTTP/1.1 server for its clients (server, connection,
request: the asyncio shell; wire, conn_state, body_budget: its rules, pure; aiohttp's web server is kept behind
``http_server: aiohttp``), the byte relay to the router (relay, over the pooled HTTP/1.1 client in
connection_pool), the relay of a session's call to the engine kvgate placed it on (placed), and several kvgate
processes on one port (processes, process_metrics). Classification, the admission
seam and the metric declarations it uses live in kvgate.common. May import kvgate.config, kvgate.common,
kvgate.sessions, kvgate.admission and kvgate.fleet; nothing imports it back except the CLI and kvgate.tools.
"""
