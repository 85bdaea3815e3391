"""The admission gate's edges that need no network: the injected engine lookup (fail-open) and the pause
action reaching the injected closer."""

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.gate import AdmissionGate
from kvgate.admission.program import Action
from kvgate.config import validate
from kvgate.proxy.metrics import Metrics


def _gate(policy="fifo", **kw):
    cfg = validate({"agentic_program_admission": True, "admission_policy": policy})
    return AdmissionGate(cfg, Metrics(), clock=lambda: 0.0, **kw)


def test_engine_lookup_is_injected_and_fails_open():
    g = _gate(engine_of=lambda sid: {"a": ("http://e0", None), "b": ("http://e0", 1)}.get(sid))
    assert g._place("a") == "http://e0" and g._place("b") == ("http://e0", 1) and g._place("zz") is None
    assert g._place(None) is None

    def broken(sid):
        raise RuntimeError("placement down")

    g = _gate(engine_of=broken)
    assert g._place("a") is None  # unknown engine: the fleet-wide rule
    assert g.metrics.faults.labels("admission")._value.get() == 1
    assert _gate()._place("a") is None  # no lookup at all


def test_pause_actions_reach_the_closer_and_a_failing_closer_is_contained():
    closed = []
    g = _gate("program", pause_session=closed.append)
    co = g.coord
    co.reconcile(ClusterSnapshot.build({"http://e0": EngineCapacity.from_pools([(10_000, 0, 0.0)])}, 0.0), 0.0)
    co.submit(1, 4000, False, 0.0, session_id="a")
    co.release(1, 0.0, {"prompt_tokens": 3900, "completion_tokens": 100})
    co.submit(2, 3000, False, 0.0, session_id="b")
    co.release(2, 0.0, {"prompt_tokens": 2900, "completion_tokens": 100})
    co.submit(3, 7000, False, 0.0, session_id="c", prompt_tokens=6000)  # new: waits
    co.submit(4, 7000, False, 0.0, session_id="a", prompt_tokens=6500)  # a continues: 3,000 + 7,000 > 9,000
    g._run_actions()
    assert closed == ["b"]

    def broken(sid):
        raise RuntimeError("lifecycle down")

    g.pause_session = broken
    co._actions.append(Action("close", "x", None))
    g._run_actions()  # logged and counted, never raised
    assert g.metrics.faults.labels("admission")._value.get() == 1
