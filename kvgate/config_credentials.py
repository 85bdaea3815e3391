"""Credentials named in the configuration (I/O edge: reads a file or the environment): the router's and the
engines' API keys kvgate sends, the admin key its own endpoints ask for, and the Redis URL (checked, and shown
without its password). A key is never logged, echoed or kept in the configuration; a key that cannot be read
raises kvgate.config.ConfigError naming the config key, never the secret."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit


def _config_error(line: str) -> Exception:
    from kvgate.config import ConfigError  # kvgate.config imports this module
    return ConfigError(line)


ADMIN_KEY_ENV = "KVGATE_ADMIN_KEY"


def read_admin_key(path: str | None) -> str | None:
    """The admin key: the first line of ``path`` (stripped), else the KVGATE_ADMIN_KEY environment variable,
    else None (no key: kvgate's endpoints are open, as before keys existed). Raises ConfigError naming
    admin_key_file for a file that cannot be read or holds no key."""
    if path is None:
        return os.environ.get(ADMIN_KEY_ENV) or None
    try:
        with open(path, encoding="utf-8") as fh:
            key = fh.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise _config_error(f"admin_key_file: {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not key:
        raise _config_error(f"admin_key_file: {path}: the first line is empty (expected the key)")
    return key


def api_key(values: Any, who: str) -> str | None:
    """The ``who`` ("router" or "engine") API key named in ``values`` (a kvgate.config.Config or a mapping) by
    ``{who}_api_key_file`` (the file's text, stripped) or ``{who}_api_key_env`` (that environment variable), or
    None when neither is set. Raises ConfigError naming the key (never the secret) when both are set, the file
    cannot be read or is empty, or the variable is unset or empty."""
    get = values.get if isinstance(values, dict) else values.values.get
    path, env = get(f"{who}_api_key_file"), get(f"{who}_api_key_env")
    if path is not None and env is not None:
        raise _config_error(f"{who}_api_key_file: set either it or {who}_api_key_env, not both")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as fh:
                key = fh.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise _config_error(f"{who}_api_key_file: cannot read {path} "
                                f"({exc.strerror if isinstance(exc, OSError) else 'not UTF-8 text'})") from None
        if not key:
            raise _config_error(f"{who}_api_key_file: {path} is empty")
        return _header_key(f"{who}_api_key_file", key)
    if env is not None:
        key = os.environ.get(env, "").strip()
        if not key:
            raise _config_error(f"{who}_api_key_env: the environment variable {env} is not set or empty")
        return _header_key(f"{who}_api_key_env", key)
    return None


def _header_key(name: str, key: str) -> str:
    # The key goes into an Authorization header: visible ASCII only (a newline would split the header).
    if not all(33 <= ord(ch) <= 126 for ch in key):
        raise _config_error(f"{name}: the key holds a space, control or non-ASCII character, which an HTTP header "
                            f"cannot carry")
    return key


def redis_url_ok(v: str) -> bool:
    """A redis://, rediss:// or unix:// URL whose database, when it names one (redis://host:port/N, or
    ?db=N), is a number: redis-py reads a path that is not one as database 0, silently (its
    connection.parse_url), and refuses a ?db= that is not one only when it connects."""
    if not v.startswith(("redis://", "rediss://", "unix://")):
        return False
    u = urlsplit(v)
    dbs = parse_qs(u.query).get("db", [])
    if u.scheme != "unix" and u.path.strip("/"):
        dbs.append(unquote(u.path).strip("/"))
    return all(d.isascii() and d.isdigit() for d in dbs)


def redis_url_shown(url: str) -> str:
    """``url`` as kvgate shows it in answers and logs: without its user and password."""
    u = urlsplit(url)
    if u.username is None and u.password is None:
        return url
    host = u.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{u.port}" if u.port is not None else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


__all__ = ["ADMIN_KEY_ENV", "api_key", "read_admin_key", "redis_url_ok", "redis_url_shown"]
