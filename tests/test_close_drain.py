"""A close that waits for the session's calls in flight goes out as soon as the last one ends, whatever the order
of the close, the calls' ends and the event loop's turns (kvgate.sessions.lifecycle: the drain before a close).

Found on the program policy: a program paused as its turn's answer was recorded (the pause's close and the end
of the call in the same turn of the event loop) waited out session_close_drain_s (30 s) before its KV was
released, 34-54 times a run on many-programs."""

import asyncio
import random

DRAIN_S = 30.0  # far longer than any wait below: a close that waits it out fails the test


async def test_a_close_goes_out_when_its_last_call_ends_in_any_order(kvgate_factory, echo_upstream):
    """Over random orders (seeded) of calls started and ended, closes and yields to the event loop, on sessions
    with 0-3 calls in flight: a session being closed is sent its close within a few loop turns of its last call
    ending (or at once with none in flight), never after the drain; while a call is in flight it is not sent."""
    gw, _ = await kvgate_factory(upstream=echo_upstream.url, agentic_session_lifecycle=True,
                                 session_close_drain_s=DRAIN_S)
    lc = gw.lifecycle
    sent: list[str] = []
    lc._send = sent.append  # the fan-out itself is tested elsewhere: here only when it starts
    rng = random.Random(7)
    for case in range(200):
        sid = f"s{case}"
        calls = rng.randint(0, 3)
        for _ in range(calls):
            lc.request_started(sid, None)
        ops = ["end"] * calls + ["close"] + ["yield"] * rng.randint(0, 3)
        rng.shuffle(ops)
        in_flight, closed = calls, False
        for op in ops:
            if op == "end":
                lc.request_finished(sid, None, None)
                in_flight -= 1
            elif op == "close":
                lc.close(sid, "pause")
                closed = True
            else:
                await asyncio.sleep(0)
            if closed and in_flight > 0:
                assert sid not in sent, (case, ops)
        task = lc._draining.get(sid)
        if task is not None:
            async with asyncio.timeout(DRAIN_S / 3):  # it ends once nothing is in flight, not at the drain
                await task
        assert sent.count(sid) == 1, (case, ops, calls)
        assert sid not in lc._drained
