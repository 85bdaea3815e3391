"""What admission logs about its capacity signal: WARNING only when the user must act, naming the real cause
(the router, or the engines), never at a normal start. Real sockets, a real smg router, simulated engines."""

import logging

from kvgate.admission.poller import degraded_cause
from kvgate.tools.procs import free_port

POLL = 0.1


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("kvgate")]


async def _rounds(gw, n: int) -> None:
    for _ in range(n):
        await gw.poller.round_done.wait()


async def test_normal_start_logs_no_warning(sim_factory, router_factory, kvgate_factory, caplog):
    caplog.set_level(logging.INFO, logger="kvgate")
    e = await sim_factory(max_total_num_tokens=2000)
    router = await router_factory([e.url])
    gw, _ = await kvgate_factory(upstream=router, agentic_program_admission=True, admission_poll_interval_s=POLL)
    await _rounds(gw, 3)
    assert not gw.gate.ledger.is_degraded(gw.gate.clock())
    assert _warnings(caplog) == []
    infos = [r.getMessage() for r in caplog.records if r.name == "kvgate.admission.poller"]
    assert infos == ["admission: KV capacity figures from 1 engines, ceiling 1800 tokens"]


async def test_router_down_is_named(kvgate_factory, caplog):
    caplog.set_level(logging.INFO, logger="kvgate")
    router = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    gw, _ = await kvgate_factory(upstream=router, agentic_program_admission=True, admission_poll_interval_s=POLL)
    await _rounds(gw, 3)
    adm = [w for w in _warnings(caplog) if w.startswith("admission degraded")]
    assert len(adm) == 1  # once, not once per round
    assert f"the router at {router} does not answer engine discovery" in adm[0]
    assert "engines did not answer" not in adm[0] and "no engines" not in adm[0]


async def test_engines_not_answering_are_named(kvgate_factory, caplog):
    caplog.set_level(logging.INFO, logger="kvgate")
    dead = f"http://127.0.0.1:{free_port()}"
    gw, _ = await kvgate_factory(upstream=f"http://127.0.0.1:{free_port()}", engines=[dead],
                                 agentic_program_admission=True, admission_poll_interval_s=POLL)
    await _rounds(gw, 3)
    adm = [w for w in _warnings(caplog) if w.startswith("admission degraded")]
    assert adm == [f"admission degraded: 1 of 1 engines did not answer GET /v1/loads or GET /metrics ({dead}); "
                   f"check that they are up (/metrics needs --enable-metrics); requests bypass the queue until then"]


def test_degraded_cause_names_one_cause():
    r = "http://r:1"
    assert degraded_cause(r, False, "ClientConnectorError: refused", ["http://e:1"], {}).startswith(
        "the router at http://r:1 does not answer engine discovery (ClientConnectorError: refused)")
    assert degraded_cause(r, False, None, [], {}).startswith("the router at http://r:1 lists no engines")
    # a static engine list has no router to blame, even if discovery never ran
    assert degraded_cause(r, True, "x", ["http://e:1", "http://e:2"],
                          {"http://e:1": "/v1/loads", "http://e:2": "failed"}).startswith(
        "1 of 2 engines did not answer GET /v1/loads or GET /metrics (http://e:2)")
    assert "stale" in degraded_cause(r, False, None, ["http://e:1"], {"http://e:1": "/metrics"})
