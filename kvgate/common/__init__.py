"""Small helpers shared by kvgate's edges (asyncio task handling, giving memory back). Imports nothing else of
kvgate."""
