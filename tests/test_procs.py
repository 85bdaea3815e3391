"""kvgate.tools.procs: how the demo and the bench react to signals, in a real subprocess (no sleeps: every step
waits for a line the child prints)."""

import signal
import subprocess
import sys

import pytest

# A stand-in for `kvgate demo`: it installs the demo's signal handling, says it is running, and on Ctrl-C says
# it is stopping, then waits for the test (stdin) before it finishes stopping: presses sent in between land while
# it stops, whatever the machine's load.
CHILD = r"""
import sys, threading
from kvgate.tools.procs import exit_on_signals
exit_on_signals()
try:
    print("running", flush=True)
    threading.Event().wait()
except KeyboardInterrupt:
    print("stopping", flush=True)
    sys.stdin.readline()
    print("stopped", flush=True)
    raise SystemExit(130)
"""


def _start(ignore_sigint: bool = False) -> subprocess.Popen:
    # Whatever the test runner's own SIGINT disposition (a background job of a non-interactive shell inherits it
    # ignored), the child starts as from an interactive terminal, or explicitly with SIGINT ignored.
    restore = signal.SIG_IGN if ignore_sigint else signal.SIG_DFL
    return subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, restore))


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_first_signal_stops_and_later_presses_are_ignored(first):
    p = _start()
    try:
        assert p.stdout.readline() == "running\n"
        p.send_signal(first)
        if first == signal.SIGINT:
            assert p.stdout.readline() == "stopping\n"
            for _ in range(5):  # Ctrl-C pressed again and again while it stops its children
                p.send_signal(signal.SIGINT)
            p.send_signal(signal.SIGTERM)
            p.stdin.write("\n")
            p.stdin.flush()
            assert p.stdout.readline() == "stopped\n"
            assert p.wait(timeout=30) == 130
        else:
            assert p.wait(timeout=30) == 128 + first
        assert "Traceback" not in p.stderr.read()
    finally:
        p.kill()
        p.wait()


def test_sigint_ignored_at_start_stays_ignored():
    """POSIX shells start background jobs with SIGINT ignored; the demo keeps it so and is stopped by SIGTERM."""
    p = _start(ignore_sigint=True)
    try:
        assert p.stdout.readline() == "running\n"
        p.send_signal(signal.SIGINT)
        p.send_signal(signal.SIGTERM)  # an ignored signal is discarded when sent
        assert p.wait(timeout=30) == 128 + signal.SIGTERM
        assert p.stdout.read() == ""  # no "stopping": the SIGINT did nothing
    finally:
        p.kill()
        p.wait()


# The demo's replay is asyncio: a Ctrl-C that lands inside a task's step (here: the task is in a blocking read
# when the signal comes, so it lands there whatever the timing) must stop asyncio.run as a whole, not end that one
# task with an exception asyncio then reports as "Task exception was never retrieved".
ASYNC_CHILD = r"""
import asyncio, sys
from kvgate.tools.procs import exit_on_signals
exit_on_signals()

async def reader():
    print("reading", flush=True)
    sys.stdin.readline()
    await asyncio.sleep(3600)

async def main():
    task = asyncio.create_task(reader())
    await asyncio.sleep(3600)

try:
    asyncio.run(main())
except KeyboardInterrupt:
    print("stopped", flush=True)
    raise SystemExit(130)
"""


def test_ctrl_c_inside_an_asyncio_task_stops_the_whole_run_quietly():
    p = subprocess.Popen([sys.executable, "-c", ASYNC_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert p.stdout.readline() == "reading\n"
        p.send_signal(signal.SIGINT)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline() == "stopped\n"
        assert p.wait(timeout=30) == 130
        err = p.stderr.read()
        assert "Traceback" not in err and "never retrieved" not in err, err
    finally:
        p.kill()
        p.wait()


# A process group whose leader and a child each burn CPU until their own process time passes a mark, then say so
# and wait for the test: the group's CPU seconds are then at least both marks.
BURNER = r"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import time, sys\nwhile time.process_time() < 0.3: pass\nprint('c', flush=True)\nsys.stdin.read()"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=OWN_GROUP)
while time.process_time() < 0.3:
    pass
assert child.stdout.readline().strip() == "c"
print("burnt", flush=True)
sys.stdin.read()
child.stdin.close(); child.wait()
"""


@pytest.mark.parametrize("own_group", [False, True])
def test_group_cpu_seconds_sums_the_live_processes_of_a_group(own_group):
    # own_group: the child runs in a process group of its own (as `kvgate serve --workers N` starts its
    # workers) and still counts for its leader's group
    from kvgate.tools.procs import group_cpu_seconds
    p = subprocess.Popen([sys.executable, "-c", f"OWN_GROUP = {own_group}\n" + BURNER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "burnt"
        used = group_cpu_seconds([p.pid, 999999999])
        # leader + child, each >= 0.3 s of CPU; /proc counts in clock ticks, sampled, so allow a tick or two each
        assert 0.5 <= used[p.pid] < 10.0
        assert used[999999999] == 0.0             # no such group
    finally:
        p.stdin.close()
        p.wait(10)


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    """The kernel offered one port twice before the engine meant for it had bound it: two engines of one bench
    fleet were given one port (the second could not listen; the router saw one worker). free_port now skips a
    port it handed out lately."""
    from kvgate.tools import procs

    offered = iter([41_001, 41_001, 41_002, 41_001, 41_003])

    class FakeSocket:
        def __init__(self, *a):
            self.port = next(offered)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, addr):
            pass

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(procs, "_HANDED_OUT", procs.collections.deque(maxlen=16))
    monkeypatch.setattr(procs.socket, "socket", FakeSocket)
    assert [procs.free_port() for _ in range(3)] == [41_001, 41_002, 41_003]
