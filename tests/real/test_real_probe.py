"""kvgate's session_id probe against real SGLang 0.5.23 engines, through smg 1.13 and sglang-router 0.3.2."""

from __future__ import annotations

import asyncio

from kvgate.fleet import compat

ALL = {r: "forwarded" for r in compat.PROBE_ROUTES}


async def _verdicts(kvgate_factory, upstream: str) -> tuple[dict[str, str], object]:
    gw, _ = await kvgate_factory(upstream=upstream, agentic_session_lifecycle=True, compat_probe=True,
                                 discovery_interval_s=0.5)
    async def settled():  # a verdict stays unknown while the router is still registering; it probes again
        while gw.directory.probes == 0 or compat.UNKNOWN in gw.directory.verdicts.values():
            await gw.directory.probed.wait()
    try:
        await asyncio.wait_for(settled(), 120)
    except TimeoutError:
        pass  # the assertion below shows which verdict stayed unknown
    return dict(gw.directory.verdicts), gw


async def test_probe_says_forwarded_through_smg_on_every_route(fleet, kvgate_factory):
    # (Each probe is refused at validation, before SGLang's tokenizer manager: it runs nothing. The engines'
    # request counters cannot show it here: SGLang 0.5.23's GET /health, which smg polls, runs a 1-token
    # generate whenever the engine is idle.)
    verdicts, gw = await _verdicts(kvgate_factory, fleet.smg)
    assert verdicts == ALL
    assert gw.directory.model_id == "kvgate-tiny"  # the OpenAI-route probes named the served model
    # kvgate read each engine's /server_info right: session cache on (0.5.23 needs nothing more), metrics and
    # the cache report on, so no warning
    assert {u: gw.directory.warnings.get(u) for u in fleet.urls} == {u: [] for u in fleet.urls}
    m = gw.metrics.render()[0].decode()
    for route in compat.PROBE_ROUTES:
        assert f'agentic_kv_router_session_id_passthrough{{route="{route}",verdict="forwarded"}} 1.0' in m


async def test_probe_says_dropped_through_sglang_router_on_generate_and_chat(fleet, kvgate_factory):
    verdicts, _ = await _verdicts(kvgate_factory, fleet.legacy)
    # sglang-router 0.3.2 re-serialises /generate and chat without session_id; it keeps it on /v1/completions.
    assert verdicts == {"/generate": "dropped", "/v1/chat/completions": "dropped", "/v1/completions": "forwarded"}


async def test_probe_straight_at_an_engine_says_forwarded(fleet, kvgate_factory):
    """With no router in between (kvgate's upstream is an engine) the engine's own answers give the verdicts."""
    verdicts, _ = await _verdicts(kvgate_factory, fleet.urls[0])
    assert verdicts == ALL
