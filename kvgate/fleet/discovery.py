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
    """One engine base URL, its role (regular|prefill|decode), the router's health verdict, its DP ranks (the
    ranks smg --dp-aware lists, else the worker's ``dp_size``; 1 when unknown) and, for a prefill worker, the
    bootstrap port the router hands the decode worker (None when not known), and the router's id for it (smg's
    /workers ``id``; None when not listed). kvgate.fleet.roles says which engines hold a session's KV."""

    url: str
    worker_type: str = "regular"
    healthy: bool = True
    dp_ranks: int = 1
    bootstrap_port: int | None = None
    worker_id: str | None = None


def engine_base_url(url: str) -> str:
    """Strip a DP-aware "@RANK" suffix and a trailing slash: "http://h:1@3/" -> "http://h:1"."""
    url = url.strip().rstrip("/")
    return _DP_SUFFIX.sub("", url).rstrip("/")


class DiscoveryError(ValueError):
    """The router's answer does not have a known shape."""


def parse_workers(obj: Any) -> list[Engine]:
    """Engines from a GET /workers answer: DP ranks collapsed, prefill and decode kept, order kept.

    An engine is healthy when any of its DP ranks is; its ``dp_ranks`` is the number of "@RANK" entries listed
    (smg --dp-aware), else the worker's ``dp_size`` (top level or in ``labels``), else 1. Raises DiscoveryError
    on an unknown shape.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("workers"), list):
        raise DiscoveryError("expected {\"workers\": [...]}")
    merged: dict[str, Engine] = {}
    ranks: dict[str, set] = {}
    for w in obj["workers"]:
        if not isinstance(w, dict) or not isinstance(w.get("url"), str):
            continue
        base = engine_base_url(w["url"])
        wtype = w.get("worker_type") if isinstance(w.get("worker_type"), str) else "regular"
        healthy = w.get("is_healthy", True) is not False
        bport = _int(w.get("bootstrap_port"))
        wid = w.get("id") if isinstance(w.get("id"), str) else None
        dp_size = _int(w.get("dp_size")) or _int((w.get("labels") or {}).get("dp_size")
                                                 if isinstance(w.get("labels"), dict) else None) or 1
        rank = _DP_SUFFIX.search(w["url"].strip().rstrip("/"))
        if rank:
            ranks.setdefault(base, set()).add(rank.group())
        prev = merged.get(base)
        if prev is not None:
            healthy = healthy or prev.healthy
            wtype = prev.worker_type
            bport = prev.bootstrap_port if prev.bootstrap_port is not None else bport
            dp_size = max(dp_size, prev.dp_ranks)
            wid = prev.worker_id if prev.worker_id is not None else wid
        listed = len(ranks.get(base, ()))
        merged[base] = Engine(base, wtype, healthy, listed or dp_size, bport, wid)
    return list(merged.values())


def _int(v: Any) -> int | None:
    """A positive int from an int or a decimal string (smg's labels are strings); None otherwise."""
    if isinstance(v, bool):
        return None
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v.strip())
    return v if isinstance(v, int) and v > 0 else None


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
