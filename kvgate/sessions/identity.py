"""Session identity: which session a generate call belongs to, and what the call says about its session (pure).

Resolution order is configurable (``session_resolution_order``); the default, first match wins:
  body        - a top-level ``session_id`` the client already sent is kept as it is;
  header      - kvgate's header (``session_header``, default X-Session-ID), then the alias headers
                (``session_header_aliases``, default Dynamo's x-dynamo-session-id);
  routing_key - the first routing-key header smg reads (``session_routing_key_headers``, smg's
                ``--routing-key-headers``, default X-SMG-Routing-Key): the key is the session id;
  field       - a configured body field (``rid``, ``user`` ...) with an optional regex capture (off by default);
  rid         - the request id's lineage: ``rid`` with one trailing ``_r<n>`` (a retry) and then one trailing
                ``_t<n>`` (a turn) stripped, as smg derives its sticky key (smg model_gateway/src/policies/
                registry.rs ``strip_lineage_suffixes``): ``abc_t1``, ``abc_t2``, ``abc_t2_r1``, ``abc_r1`` are
                session ``abc``. By default (``session_rid_lineage: suffixed``) only a rid that carries such a
                suffix names a session: many clients send a fresh random rid per call, which would otherwise make
                every call its own session and leave prefix inference nothing to do.
Prefix inference (kvgate.sessions.inference) is the last step.

What a call says about its session's end and family (:func:`session_marks`): a final-turn marker
(``X-Session-Final: true``, Dynamo's ``x-dynamo-session-final: true``) and a subagent's parent
(``x-dynamo-parent-session-id``, ``X-Parent-Session-ID``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Any

SOURCES = ("body", "header", "routing_key", "field", "rid")
DEFAULT_ORDER = ("body", "header", "routing_key", "field", "rid")

#: Headers that mark the call as its session's last turn (value true/1/yes, any case).
FINAL_HEADERS = ("X-Session-Final", "x-dynamo-session-final")
#: Headers naming the session a subagent's session belongs to.
PARENT_HEADERS = ("X-Parent-Session-ID", "x-dynamo-parent-session-id")
_TRUE = frozenset({"true", "1", "yes"})


@dataclass(slots=True)
class Resolution:
    """The outcome: ``session_id`` (None when unresolved) and ``source`` (body|header|routing_key|field|rid|None).

    ``inject`` is True when the body does not already carry that id as its top-level session_id.
    """

    session_id: str | None
    source: str | None
    inject: bool


UNRESOLVED = Resolution(None, None, False)


def _strip_tag(s: str, tag: str) -> str:
    head, sep, tail = s.rpartition("_")
    if not sep or not tail.startswith(tag):
        return s
    digits = tail[1:]
    return head if digits and digits.isascii() and digits.isdigit() else s


def rid_lineage(rid: str) -> str:
    """The session key of a request id, as smg strips it: one trailing ``_r<n>``, then one trailing ``_t<n>``
    (``conv_t2_r1`` -> ``conv``); a rid that is nothing but suffix keys as itself (``_t1`` -> ``_t1``)."""
    stripped = _strip_tag(_strip_tag(rid, "r"), "t")
    return stripped or rid


def has_lineage(rid: str) -> bool:
    """Whether ``rid`` carries a turn or retry suffix smg strips."""
    return rid_lineage(rid) != rid


def session_marks(headers: Mapping[str, str]) -> tuple[bool, str | None]:
    """(final, parent) from one call's headers: ``final`` when a final-turn marker says true; ``parent`` the
    parent session's id a subagent's call names (None when none does, or it is empty)."""
    final = False
    for name in FINAL_HEADERS:
        v = headers.get(name)
        if v is not None and v.strip().lower() in _TRUE:
            final = True
            break
    parent = None
    for name in PARENT_HEADERS:
        v = headers.get(name)
        if v:
            parent = v
            break
    return final, parent


class SessionResolver:
    """Resolves a session id from a parsed generate body and the request headers.

    order: sequence of SOURCES; header: kvgate's header (case-insensitive); header_aliases: further headers
    read by the header step, in order; routing_key_headers: the routing-key headers, in order (smg's
    --routing-key-headers); field: body field name or None; field_regex: pattern whose first group (or whole
    match) is the id; rid_lineage: "suffixed" (a rid with a _t<n>/_r<n> suffix names its session), "any"
    (every rid does, stripped) or "off". Raises re.error at construction for a bad pattern (config validation
    catches it first), ValueError for an unknown source or rid_lineage.
    """

    def __init__(self, order: Sequence[str] = DEFAULT_ORDER, header: str = "X-Session-ID",
                 field: str | None = None, field_regex: str | None = None,
                 header_aliases: Sequence[str] = ("x-dynamo-session-id",),
                 routing_key_headers: Sequence[str] = ("X-SMG-Routing-Key",), rid_lineage: str = "suffixed"):
        self.order = tuple(order)
        unknown = [s for s in self.order if s not in SOURCES]
        if unknown:
            raise ValueError(f"unknown session source {unknown[0]!r}")
        if rid_lineage not in ("suffixed", "any", "off"):
            raise ValueError(f"rid_lineage must be suffixed, any or off, got {rid_lineage!r}")
        self.header = header
        self.headers = (header, *[h for h in header_aliases if h.lower() != header.lower()])
        self.routing_key_headers = tuple(routing_key_headers)
        self.field = field
        self.pattern = re.compile(field_regex) if field_regex else None
        self.rid_mode = rid_lineage

    def _from_field(self, body: Mapping[str, Any]) -> str | None:
        if not self.field:
            return None
        value = body.get(self.field)
        if isinstance(value, list):
            # Batch form: a rid per sequence; one session id only if they all agree.
            ids = {self._capture(v) for v in value}
            return ids.pop() if len(ids) == 1 else None
        return self._capture(value)

    def _capture(self, value: Any) -> str | None:
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            return None
        text = str(value)
        if self.pattern is None:
            return text or None
        m = self.pattern.search(text)
        if m is None:
            return None
        got = m.group(1) if m.groups() else m.group(0)
        return got or None

    def _from_rid(self, body: Mapping[str, Any]) -> str | None:
        if self.rid_mode == "off":
            return None
        rid = body.get("rid")
        rids = rid if isinstance(rid, list) else [rid]
        keys = set()
        for r in rids:  # a batch: one session only when every rid has the same lineage
            if not isinstance(r, str) or not r:
                return None
            if self.rid_mode == "suffixed" and not has_lineage(r):
                return None
            keys.add(rid_lineage(r))
        return keys.pop() if len(keys) == 1 else None

    @staticmethod
    def _first_header(headers: Mapping[str, str], names: Sequence[str]) -> str | None:
        for name in names:
            value = headers.get(name)
            if value:
                return value
        return None

    def resolve(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> Resolution:
        """Return the Resolution for one generate call; never raises on odd input."""
        existing = body.get("session_id")
        for source in self.order:
            if source == "body":
                if isinstance(existing, str) and existing:
                    return Resolution(existing, "body", False)
                continue
            if source == "header":
                value = self._first_header(headers, self.headers)
            elif source == "routing_key":
                value = self._first_header(headers, self.routing_key_headers)
            elif source == "field":
                value = self._from_field(body)
            else:
                value = self._from_rid(body)
            if value:
                return Resolution(value, source, existing != value)
        return UNRESOLVED
