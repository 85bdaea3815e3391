"""Simulated engines that share a host's cores (kvgate/sim/host.py): the rule, the board the engines share
(in one process and across processes), and an engine whose batches take longer while another engine computes."""

import subprocess
import sys
import time

import pytest

from kvgate.sim.host import SLOTS, HostBoard, contended_seconds
from kvgate.sim.http_api import start_sim_engine
from kvgate.sim.scheduler import Request


def test_contended_seconds_is_linear_in_the_other_busy_engines():
    assert contended_seconds(0.2, 0, 0.8) == 0.2
    assert contended_seconds(0.2, 1, 0.8) == pytest.approx(0.36)
    assert contended_seconds(0.2, 3, 0.5) == pytest.approx(0.5)
    assert contended_seconds(0.2, 2, 0.0) == 0.2
    with pytest.raises(ValueError):
        contended_seconds(0.2, 1, -0.1)
    with pytest.raises(ValueError):
        contended_seconds(0.2, -1, 0.5)


def test_boards_in_one_process_take_distinct_slots_see_each_other_and_free_their_slot(tmp_path):
    d = str(tmp_path / "board")
    a, b = HostBoard(d), HostBoard(d)
    assert (a.slot, b.slot) == (0, 1)
    now = time.monotonic()
    assert a.others_busy(now) == 0
    b.busy_until(now + 60)
    assert (a.others_busy(now), b.others_busy(now)) == (1, 0)
    assert a.others_busy(now + 61) == 0           # past its batch's end it is idle
    b.close()
    b.close()                                      # idempotent
    assert a.others_busy(now) == 0                 # closing zeroes the slot
    c = HostBoard(d)
    assert c.slot == 1                             # the freed slot is taken again
    a.close()
    c.close()


def test_a_full_board_says_so(tmp_path):
    d = str(tmp_path / "board")
    boards = [HostBoard(d) for _ in range(SLOTS)]
    try:
        with pytest.raises(RuntimeError, match="all 64 slots are taken"):
            HostBoard(d)
    finally:
        for b in boards:
            b.close()


def test_a_board_held_by_another_process_is_seen_and_its_slot_freed_when_the_process_ends(tmp_path):
    d = str(tmp_path / "board")
    # the child computes for the next 600 s (as far as the board says), then waits for the test
    code = ("import sys, time; from kvgate.sim.host import HostBoard; b = HostBoard(sys.argv[1]); "
            "b.busy_until(time.monotonic() + 600); print(b.slot, flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "0"
        a = HostBoard(d)
        assert a.slot == 1
        now = time.monotonic()
        assert a.others_busy(now) == 1                # the other process's batch
        assert a.others_busy(now + 601) == 0          # past its end
    finally:
        p.stdin.close()
        p.wait(10)
    b = HostBoard(d)
    assert b.slot == 0                              # the kernel dropped the dead process's lock
    assert a.others_busy(time.monotonic()) == 0     # and the new holder cleared the dead one's busy time
    a.close()
    b.close()


async def test_a_batch_takes_longer_by_the_slowdown_while_another_engine_computes(tmp_path):
    d = str(tmp_path / "board")
    # prefill 100 ids at 1,000 tokens/s = 0.1 simulated s alone; speed 10 keeps the test short
    opts = dict(max_total_num_tokens=10000, speed=10.0, prefill_tokens_per_s=1000.0, decode_base_ms=10.0,
                decode_per_seq_ms=0.0, decode_per_ctx_token_us=0.0, host_board=d,
                host_contention_prefill=1.0, host_contention_decode=0.5)
    h = await start_sim_engine(**opts)
    other = HostBoard(d)
    try:
        r1 = h.engine.submit(Request("alone", tuple(range(100, 200)), max_new_tokens=1))
        await r1.wait()
        st = h.stats()["totals"]
        assert st["host_contended_batches"] == 0 and st["host_contention_seconds"] == 0
        other.busy_until(time.monotonic() + 3600)   # another engine computes for the rest of the test
        r2 = h.engine.submit(Request("shared", tuple(range(300, 400)), max_new_tokens=1))
        await r2.wait()
        st = h.stats()["totals"]
        assert st["host_contended_batches"] == 1
        # one extra prefill time (slowdown 1.0 x one other engine), in simulated seconds
        assert st["host_contention_seconds"] == pytest.approx(0.1, abs=1e-3)
        r3 = h.engine.submit(Request("decode", tuple(range(500, 600)), max_new_tokens=5))
        await r3.wait()
        st2 = h.stats()["totals"]
        assert st2["host_contended_batches"] == 1 + 1 + 4   # its prefill, then 4 decode steps
        assert st2["host_contention_seconds"] - st["host_contention_seconds"] == pytest.approx(
            0.1 + 4 * 0.5 * 0.010, abs=1e-3)
    finally:
        other.close()
        await h.close()
