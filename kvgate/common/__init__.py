"""Small helpers shared by kvgate's edges and cores: asyncio task handling, giving memory back, chained
prompt-block hashes. Imports nothing else of kvgate."""
