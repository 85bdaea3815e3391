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


def test_every_gate_has_what_the_protocol_names_and_the_gateway_detects_nothing():
    """The Gate protocol names everything the gateway calls on a gate; both gates have all of it, so the
    gateway calls it without asking first (no getattr, hasattr or isinstance on its gate)."""
    import inspect

    from kvgate.admission.gate import AdmissionGate
    from kvgate.common.admission_seam import Gate, OpenGate
    from kvgate.common.metrics import Metrics
    from kvgate.config import validate
    names = {n for n, v in vars(Gate).items() if callable(v) and not n.startswith("_")} | set(Gate.__annotations__)
    assert names == {"acquire", "release", "start", "stop", "stats", "forget", "reads_headers", "shared"}
    admission = AdmissionGate(validate({"agentic_program_admission": True}), Metrics())
    for gate in (OpenGate(), admission):
        for name in names:
            assert hasattr(gate, name), (type(gate).__name__, name)
            if callable(getattr(Gate, name, None)):
                assert inspect.signature(getattr(gate, name)).parameters.keys() == \
                    inspect.signature(getattr(Gate, name)).parameters.keys() - {"self"}, name
    assert OpenGate().stats() == {"admission": "off"}
    source = (ROOT / "proxy" / "app.py").read_text() + (ROOT / "proxy" / "admin.py").read_text()
    for probe in ("getattr(self.gate", "hasattr(self.gate", "isinstance(self.gate", "type(gate)",
                  "getattr(self.gw.gate"):
        assert probe not in source, probe
