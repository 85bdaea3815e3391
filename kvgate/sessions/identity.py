"""Session identity: which session a generate call belongs to (pure).

Resolution order is configurable; the default is
  body   - a top-level ``session_id`` the client already sent is kept as it is;
  header - else a configured header (default X-Session-ID);
  field  - else a configured body field (``rid``, ``user`` ...) with an optional regex capture.
Prefix inference (kvgate.sessions.inference) is the last step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Any


@dataclass(slots=True)
class Resolution:
    """The outcome: ``session_id`` (None when unresolved) and ``source`` (body|header|field|None).

    ``inject`` is True when the body does not already carry that id as its top-level session_id.
    """

    session_id: str | None
    source: str | None
    inject: bool


UNRESOLVED = Resolution(None, None, False)


class SessionResolver:
    """Resolves a session id from a parsed generate body and the request headers.

    order: sequence of "body", "header", "field"; header: header name (case-insensitive);
    field: body field name or None; field_regex: pattern whose first group (or whole match) is the id.
    Raises re.error at construction for a bad pattern (config validation catches it first).
    """

    def __init__(self, order: Sequence[str] = ("body", "header", "field"), header: str = "X-Session-ID",
                 field: str | None = None, field_regex: str | None = None):
        self.order = tuple(order)
        self.header = header
        self.field = field
        self.pattern = re.compile(field_regex) if field_regex else None

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

    def resolve(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> Resolution:
        """Return the Resolution for one generate call; never raises on odd input."""
        existing = body.get("session_id")
        for source in self.order:
            if source == "body":
                if isinstance(existing, str) and existing:
                    return Resolution(existing, "body", False)
            elif source == "header":
                value = headers.get(self.header)
                if value:
                    return Resolution(value, "header", existing != value)
            elif source == "field":
                value = self._from_field(body)
                if value:
                    return Resolution(value, "field", existing != value)
        return UNRESOLVED
