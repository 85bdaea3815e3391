"""A call that went out before a heartbeat found Redis back, and fails after it, does not take Redis for down
again, as a property over random interleavings.

A call can outlive an outage when Redis stops answering without closing its connections (a network
partition, a frozen server): it fails only at its timeout, possibly after another call took Redis for down
and the heartbeat found it back. Its failure is news of the outage that ended, not of a new one: taking Redis
for down again would make every path fall back (and the write batch drop what is queued) until the next
heartbeat, a second after Redis was back. A fake client holds each call until the test answers or fails it;
a model says whether Redis is taken for up after each step: a failure counts only when no recovery came
since its call went out.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import orjson
from hypothesis import given, settings, strategies as st

from conftest import ManualClock, until_state
from kvgate.common.metrics import Metrics
from kvgate.shared.redis_state import SharedState


class FakeRedis:
    """The calls SharedState makes here, each held until the test settles it (the heartbeat's SET answers at
    once: OK, or a ConnectionError when ``beat_fails``)."""

    def __init__(self):
        self.held: list[asyncio.Future] = []
        self.beat_fails = False

    def register_script(self, src):
        return object()

    async def set(self, *a, **kw):
        if self.beat_fails:
            raise ConnectionError("refused")
        return True

    async def get(self, key):
        return await self._hold()

    async def batch(self, keys, args):
        n = len(orjson.loads(args[0]))
        await self._hold()
        return [1] * n

    async def _hold(self):
        f = asyncio.get_running_loop().create_future()
        self.held.append(f)
        return await f


@dataclass
class Held:
    kind: str              # call | batch
    future: asyncio.Future
    gen: int               # the model's recoveries when it went out
    task: asyncio.Task | None = None


@dataclass
class Model:
    up: bool = True
    gen: int = 0
    held: list[Held] = field(default_factory=list)


_settle = st.tuples(st.sampled_from(["fail", "answer"]), st.integers(0, 7))
# Rounds: calls go out, the outage is seen (a heartbeat, one held call failing) or not, the heartbeat may find
# Redis back, then held calls are settled in a random order; rounds may leave calls held for the next ones.
_round = st.tuples(st.lists(st.sampled_from(["call", "batch"]), max_size=4),
                   st.sampled_from([["beat_fail"], [("fail", 0)], []]), st.booleans(), st.lists(_settle, max_size=6))
steps = st.lists(_round, min_size=1, max_size=4).map(
    lambda rounds: [step for sent, seen, back, settled in rounds
                    for step in [*sent, *seen, *(["beat_ok"] if back else []), *settled]])


async def _scenario(plan) -> None:
    fake = FakeRedis()
    st_ = SharedState("redis://fake", "f:", 3600, 60.0, Metrics(), wall=ManualClock(), client=fake, replica_id="r")
    st_.register_scripts()
    st_._scripts["batch"] = fake.batch
    m = Model()
    n = 0
    try:
        for step in plan:
            n += 1
            if step == "call":
                before = len(fake.held)
                task = asyncio.ensure_future(st_.engine_of(f"s{n}"))
                if m.up:
                    await until_state(lambda: len(fake.held) > before, "the call goes out")
                    m.held.append(Held("call", fake.held[-1], m.gen, task))
                else:
                    assert await task is None and len(fake.held) == before  # no call while down
            elif step == "batch":
                if any(h.kind == "batch" for h in m.held):
                    continue  # one batch in flight at a time: keep the model's order plain
                before = len(fake.held)
                st_.turn_started(f"s{n}")
                if m.up:
                    await until_state(lambda: len(fake.held) > before, "the batch goes out")
                    m.held.append(Held("batch", fake.held[-1], m.gen))
                else:
                    assert len(fake.held) == before
            elif step in ("beat_ok", "beat_fail"):
                fake.beat_fails = step == "beat_fail"
                await st_._heartbeat_once()
                if step == "beat_fail":
                    m.up = False
                elif not m.up:
                    m.up, m.gen = True, m.gen + 1
            else:
                what, k = step
                if not m.held:
                    continue
                h = m.held.pop(k % len(m.held))
                if what == "fail":
                    h.future.set_exception(ConnectionError("timed out"))
                    if h.gen == m.gen:  # news of now: Redis is taken for down
                        m.up = False
                else:
                    h.future.set_result(None)
                if h.task is not None:
                    await h.task
                else:
                    await until_state(lambda: not st_._batch.in_flight, "the batch is settled")
            assert st_.up == m.up, (step, plan)
    finally:
        for h in m.held:
            if not h.future.done():
                h.future.set_result(None)
        await st_.stop()


@settings(max_examples=200, deadline=None)
@given(plan=steps)
def test_a_failure_older_than_the_latest_recovery_leaves_redis_up(plan):
    asyncio.run(_scenario(plan))


def test_a_call_that_hung_through_the_outage_fails_after_the_recovery():
    """The case written out: a placement read hangs, a batch fails at once (Redis taken for down), the
    heartbeat finds Redis back, then the read times out: Redis stays up, and the next batch goes."""
    asyncio.run(_scenario(["call", "batch", ("fail", 1), "beat_ok", ("fail", 0), "batch", ("answer", 0)]))
