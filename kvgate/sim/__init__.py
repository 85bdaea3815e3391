"""SGLang engine simulator: pure KV/scheduler core (radix, scheduler, metrics, tokenizer)
plus a thin aiohttp shell (engine, server) and a CLI (cli)."""
