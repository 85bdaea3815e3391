"""A fleet for client-compatibility tests: simulated engine -> ScriptedWorker -> real smg -> kvgate with
session lifecycle and admission on; plus waits on kvgate's own events (never on sleeps)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from scripted_worker import ScriptedWorker


@dataclass
class Fleet:
    """A running fleet: the engine, the worker in front of it, smg, kvgate, and what the test spies on."""

    engine: object        # the in-process simulated engine handle
    worker: ScriptedWorker
    router: str           # smg's base URL
    gw: object            # the kvgate Gateway
    kv: str               # kvgate's base URL
    reservations: list    # (ticket, tokens) the admission gate was asked for, in order
    turn_ended: asyncio.Condition  # notified each time kvgate records the end of a turn


@pytest.fixture
async def fleet(sim_factory, router_factory, kvgate_factory):
    """``await make(engine_opts=None, router_extra=None, **kvgate_cfg)`` -> Fleet with admission ready."""
    workers = []

    async def make(engine_opts=None, router_extra=None, **cfg) -> Fleet:
        e = await sim_factory(**{"max_total_num_tokens": 60_000, "speed": 50, **(engine_opts or {})})
        w = await ScriptedWorker().start(e.url)
        workers.append(w)
        router = await router_factory([w.url], extra=router_extra)
        gw, kv = await kvgate_factory(upstream=router, agentic_session_lifecycle=True,
                                      agentic_program_admission=True, admission_poll_interval_s=0.1,
                                      discovery_interval_s=0.2, **cfg)
        await gw.directory.first_refresh.wait()
        while gw.gate.ledger.snapshot is None or gw.gate.ledger.ceiling == 0:
            await gw.poller.round_done.wait()
        reservations = []
        submit = gw.gate.coord.submit

        def spy(ticket, tokens, protected, now, **kw):
            reservations.append((ticket, tokens))
            return submit(ticket, tokens, protected, now, **kw)

        gw.gate.coord.submit = spy
        turn_ended = asyncio.Condition()
        finished = gw.lifecycle.request_finished

        def notify(*args, **kwargs):
            out = finished(*args, **kwargs)

            async def wake():
                async with turn_ended:
                    turn_ended.notify_all()
            asyncio.get_running_loop().create_task(wake())
            return out

        gw.lifecycle.request_finished = notify
        return Fleet(e, w, router, gw, kv, reservations, turn_ended)

    yield make
    for w in workers:
        await w.close()


async def settled(f: Fleet, sid: str, turns: int):
    """The session's registry entry once ``turns`` turns have finished (the registry is updated just
    after the response is relayed, so the client may see its answer first)."""
    reg = f.gw.lifecycle.registry

    async def wait():
        async with f.turn_ended:
            await f.turn_ended.wait_for(lambda: (s := reg.get(sid)) is not None and s.turns == turns
                                        and s.in_flight == 0)
    await asyncio.wait_for(wait(), 10)
    return reg.get(sid)


def metric(f: Fleet, line_start: str) -> float:
    for line in f.gw.metrics.render()[0].decode().splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


