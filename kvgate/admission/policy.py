"""Scope and protection of a request (pure): which requests admission may hold.

Source: Relax's admission rules: protected and scope are decided from the
request: headers (X-Kvgate-Protected: 1, X-Kvgate-Scope: eval|train) and configurable match rules (path,
body field values). Scope train (default) holds only training work; scope all holds eval work too.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Iterable

from multidict import CIMultiDict, CIMultiDictProxy

__all__ = [
    "HEADER_PROTECTED",
    "HEADER_SCOPE",
    "SCOPES",
    "MatchRule",
    "ScopeRules",
    "classify_scope",
]

HEADER_PROTECTED = "X-Kvgate-Protected"
HEADER_SCOPE = "X-Kvgate-Scope"
SCOPES = ("train", "all")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_MISSING = object()


def _norm_path(path: str) -> str:
    p = str(path or "").split("?", 1)[0]
    return p.rstrip("/") or "/"


def _get_field(body: Any, dotted: str) -> Any:
    cur = body
    for part in dotted.split("."):
        if isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return _MISSING
    return cur


@dataclass(frozen=True)
class MatchRule:
    """Matches a request when every given condition holds.

    path: fnmatch glob on the request path without query (e.g. "/v1/*", "/generate"); None = any path.
    field: dotted path into the JSON body (e.g. "metadata.split", "sampling_params.priority"; list indices
    as digits); None = no body condition. equals: accepted values for ``field`` (compared as-is and as
    strings, so 1 matches "1"); empty = the field only has to be present and not null.
    A rule with neither path nor field matches everything.
    """

    path: str | None = None
    field: str | None = None
    equals: tuple[Any, ...] = ()

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "MatchRule":
        """Build from a config mapping {path?, field?, equals?: value | [values]}; raises ValueError on bad keys."""
        if not isinstance(d, Mapping):
            raise ValueError(f"match rule must be a mapping, got {d!r}")
        unknown = set(d) - {"path", "field", "equals"}
        if unknown:
            raise ValueError(f"unknown match rule keys: {sorted(unknown)}")
        eq = d.get("equals", ())
        if eq is None:
            eq = ()
        elif not isinstance(eq, (list, tuple)):
            eq = (eq,)
        return cls(path=d.get("path"), field=d.get("field"), equals=tuple(eq))

    def matches(self, path: str, body: Any) -> bool:
        """True if ``path`` (str) and ``body`` (parsed JSON, any type) satisfy the rule. Never raises."""
        if self.path is not None and not fnmatch.fnmatchcase(_norm_path(path), self.path):
            return False
        if self.field is not None:
            v = _get_field(body, self.field)
            if v is _MISSING or v is None:
                return False
            if self.equals:
                return any(_same(v, e) for e in self.equals)
        return True


def _scalar_str(x: Any) -> str | None:
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, (str, int, float)):
        return str(x)
    return None


def _same(v: Any, e: Any) -> bool:
    sv, se = _scalar_str(v), _scalar_str(e)
    if sv is not None and se is not None:
        return sv == se
    return v == e


@dataclass(frozen=True)
class ScopeRules:
    """Configuration for :func:`classify_scope`.

    scope: "train" (default: eval work is out of scope and never held) or "all". protected: rules that mark a
    request protected (bypasses admission). eval: rules that mark a request as eval work.
    """

    scope: str = "train"
    protected: tuple[MatchRule, ...] = ()
    eval: tuple[MatchRule, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")

    @classmethod
    def from_config(cls, scope: str = "train", protected: Iterable[Mapping[str, Any]] = (), eval: Iterable[Mapping[str, Any]] = ()) -> "ScopeRules":
        """Build from config values: scope string and lists of rule mappings (see MatchRule.from_config)."""
        return cls(scope=scope, protected=tuple(MatchRule.from_config(r) for r in protected or ()), eval=tuple(MatchRule.from_config(r) for r in eval or ()))


def _header(headers: Any, name: str) -> str | None:
    if headers is None:
        return None
    if isinstance(headers, (CIMultiDictProxy, CIMultiDict)) or getattr(headers, "case_insensitive", False):
        # aiohttp's multidicts, kvgate's server's Headers: one case-insensitive lookup
        v = headers.get(name)
        return None if v is None else str(v).strip().lower()
    lname = name.lower()
    try:
        items = headers.items()
    except AttributeError:
        items = headers
    for k, v in items:
        if str(k).lower() == lname:
            return str(v).strip().lower()
    return None


def classify_scope(path: str, headers: Any, body: Any, rules: ScopeRules | None = None) -> tuple[bool, bool]:
    """Return (protected, in_scope) for a request.

    headers: any mapping or (name, value) pairs, looked up case-insensitively (aiohttp CIMultiDict works).
    protected: header X-Kvgate-Protected 1/true/yes/on -> True, 0/false/no/off -> False (header wins),
    else any ``rules.protected`` rule matches. Eval work: header X-Kvgate-Scope eval -> eval, train -> train
    (header wins), else any ``rules.eval`` rule matches. in_scope = scope == "all" or not eval.
    The caller leaves out-of-scope requests untouched (X-Kvgate-Admission: off) before asking about
    protection first, then scope. Never raises.
    """
    rules = rules or ScopeRules()
    hp = _header(headers, HEADER_PROTECTED)
    if hp in _TRUE:
        protected = True
    elif hp in _FALSE:
        protected = False
    else:
        protected = bool(rules.protected) and any(r.matches(path, body) for r in rules.protected)
    hs = _header(headers, HEADER_SCOPE)
    if hs == "eval":
        is_eval = True
    elif hs == "train":
        is_eval = False
    else:
        is_eval = bool(rules.eval) and any(r.matches(path, body) for r in rules.eval)
    in_scope = rules.scope == "all" or not is_eval
    return protected, in_scope
