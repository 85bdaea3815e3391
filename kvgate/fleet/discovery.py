"""Engine discovery: which engine base URLs sit behind the router (pure parsing).

Shapes (measured; docs/compatibility.md): smg and sglang-router >= 0.2.0 answer GET /workers with
{"workers":[{"url", "worker_type": regular|prefill|decode, "is_healthy", ...}], ...};
sglang-router <= 0.2.1 answers GET /list_workers with {"urls": [...]}. With --dp-aware every DP
rank is its own worker "http://host:port@RANK": the engine is the URL without "@RANK".
The poller that calls these lives in kvgate.fleet.directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_DP_SUFFIX = re.compile(r"@\d+$")


@dataclass(frozen=True)
class Engine:
    """One engine base URL, its role (regular|prefill|decode) and the router's health verdict."""

    url: str
    worker_type: str = "regular"
    healthy: bool = True


def engine_base_url(url: str) -> str:
    """Strip a DP-aware "@RANK" suffix and a trailing slash: "http://h:1@3/" -> "http://h:1"."""
    url = url.strip().rstrip("/")
    return _DP_SUFFIX.sub("", url).rstrip("/")


class DiscoveryError(ValueError):
    """The router's answer does not have a known shape."""


def parse_workers(obj: Any) -> list[Engine]:
    """Engines from a GET /workers answer: DP ranks collapsed, prefill and decode kept, order kept.

    An engine is healthy when any of its DP ranks is. Raises DiscoveryError on an unknown shape.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("workers"), list):
        raise DiscoveryError("expected {\"workers\": [...]}")
    merged: dict[str, Engine] = {}
    for w in obj["workers"]:
        if not isinstance(w, dict) or not isinstance(w.get("url"), str):
            continue
        base = engine_base_url(w["url"])
        wtype = w.get("worker_type") if isinstance(w.get("worker_type"), str) else "regular"
        healthy = w.get("is_healthy", True) is not False
        prev = merged.get(base)
        if prev is not None:
            healthy = healthy or prev.healthy
            wtype = prev.worker_type
        merged[base] = Engine(base, wtype, healthy)
    return list(merged.values())


def parse_list_workers(obj: Any) -> list[Engine]:
    """Engines from a GET /list_workers answer ({"urls": [...]}). Raises DiscoveryError on another shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("urls"), list):
        raise DiscoveryError("expected {\"urls\": [...]}")
    seen: dict[str, Engine] = {}
    for u in obj["urls"]:
        if isinstance(u, str):
            base = engine_base_url(u)
            seen.setdefault(base, Engine(base))
    return list(seen.values())


def static_engines(urls: list[str]) -> list[Engine]:
    """Engines from the config's static ``engines:`` list (deduplicated, DP suffix stripped)."""
    return parse_list_workers({"urls": urls})
