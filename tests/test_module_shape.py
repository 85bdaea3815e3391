"""The shape the code keeps: small admission modules, and a request handler that reads as its stages."""

import inspect
from pathlib import Path

import kvgate
from kvgate.proxy.app import Gateway

ROOT = Path(kvgate.__file__).parent


def test_no_admission_module_over_600_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "admission").glob("*.py")}
    assert sizes and max(sizes.values()) <= 600, {k: v for k, v in sizes.items() if v > 600}


def test_the_request_handler_is_its_list_of_stages():
    src = inspect.getsource(Gateway.handle_proxy)
    assert len(src.splitlines()) <= 40
    order = ["_classify", "_session_stage", "_place_stage", "_admit_stage", "_forward", "_release_and_record"]
    at = [src.index(f"self.{name}(") for name in order]
    assert at == sorted(at), "stages out of order"


def test_no_module_outside_admission_over_800_lines_and_the_server_and_gateway_within_600():
    """Modules stay small enough to read: none of kvgate/ outside admission/ over 800 lines, the HTTP server and
    the gateway (split by responsibility) within 600; no two modules of kvgate/ share a file name."""
    files = [p for p in ROOT.rglob("*.py") if "admission" not in p.relative_to(ROOT).parts]
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in files}
    assert max(sizes.values()) <= 800, {k: v for k, v in sizes.items() if v > 800}
    assert sizes["proxy/server.py"] <= 600 and sizes["proxy/app.py"] <= 600
    names = [p.name for p in ROOT.rglob("*.py") if p.name != "__init__.py"]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
