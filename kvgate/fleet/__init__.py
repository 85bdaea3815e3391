"""The engine fleet behind the router: which engine base URLs exist and whether they are set up for sessions.

Owns worker discovery from the router's /workers (discovery, pure), compatibility verdicts such as "does the
router forward session_id" (compat, pure), which engine a session's calls go to when kvgate places them
(placement, pure), what /kvgate/health says about the router and the engines (health, pure), which engines hold sessions' KV
(roles, pure: decode workers in a prefill/decode fleet, regular engines otherwise) and the live
engine directory that keeps the list, the verdicts and the router's and engines' health fresh (directory, I/O
edge). May import kvgate.common.
"""
