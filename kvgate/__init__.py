"""kvgate: a session- and KV-aware reverse proxy in front of the SGLang router."""

__version__ = "0.1.0"
