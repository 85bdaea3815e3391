"""File names say one thing: no two modules in kvgate/ share a basename (``__init__.py`` aside), so a name in
a traceback, a log line or a doc points at one file."""

from __future__ import annotations

import collections
from pathlib import Path

import kvgate

ROOT = Path(kvgate.__file__).resolve().parent


def test_no_two_modules_in_kvgate_share_a_basename():
    by_name: dict[str, list[str]] = collections.defaultdict(list)
    for path in ROOT.rglob("*.py"):
        if path.name != "__init__.py":
            by_name[path.name].append(str(path.relative_to(ROOT)))
    shared = {name: sorted(paths) for name, paths in by_name.items() if len(paths) > 1}
    assert shared == {}
    assert len(by_name) > 50  # the walk saw the package, not an empty directory
