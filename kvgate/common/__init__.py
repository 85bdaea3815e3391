"""Small helpers shared by kvgate's edges (asyncio task handling). Imports nothing else of kvgate."""
