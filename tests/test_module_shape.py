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
