"""The supervisor of several kvgate processes (``workers: N``) says ``cannot listen on`` only when bind() refused
the address; any other step of preparing the processes that fails (no socket, the host no longer resolves, the
run directory or the processes' configuration cannot be written) is one line saying that step and the system's
words, and leaves no run directory behind."""

from __future__ import annotations

import errno
import os
import socket
import tempfile
from pathlib import Path
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.config import validate
from kvgate.proxy import processes
from kvgate.proxy.bootstrap import listen_error
from kvgate.proxy.processes import BindError, StartupError, Supervisor, supervise

CFG = validate({"workers": 2, "state_backend": "redis", "port": 0})
TMP = tempfile.gettempdir()


def _runs() -> set[str]:
    return {p.name for p in Path(TMP).glob("kvgate-processes-*")}


def _prepare_line(step: str, err: int) -> str:
    """What Supervisor.prepare raises when ``step`` fails with errno ``err``."""
    exc = OSError(err, os.strerror(err))
    patches = {
        "bind": mock.patch.object(processes, "reserve_port", side_effect=BindError(err, os.strerror(err))),
        "socket": mock.patch.object(processes, "reserve_port", side_effect=exc),
        "mkdtemp": mock.patch.object(processes.tempfile, "mkdtemp", side_effect=exc),
        "write": mock.patch.object(processes, "write_json_atomic", side_effect=exc),
    }
    sup = Supervisor(CFG)
    with patches[step]:
        try:
            sup.prepare()
        except StartupError as e:
            return str(e)
        finally:
            sup.stop()
    raise AssertionError(f"{step} failing with {err} did not stop prepare")


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["bind", "socket", "mkdtemp", "write"]), st.sampled_from(sorted(errno.errorcode)))
def test_only_a_bind_failure_says_cannot_listen(step, err):
    before = _runs()
    line = _prepare_line(step, err)
    assert "\n" not in line and line.startswith("kvgate: startup error: cannot ")
    words = os.strerror(err)
    if step == "bind":
        assert line == listen_error("127.0.0.1", 0, err)
    else:
        assert "cannot listen" not in line
        expected = {
            "socket": f"kvgate: startup error: cannot open a socket for 127.0.0.1:0 ({words})",
            "mkdtemp": f"kvgate: startup error: cannot create the worker processes' run directory in {TMP} ({words})",
        }.get(step)
        if expected is not None:
            assert line == expected
        else:
            head = f"kvgate: startup error: cannot write the worker processes' configuration to {TMP}/kvgate-processes-"
            assert line.startswith(head) and line.endswith(f" ({words})"), line
    assert _runs() <= before  # nothing left behind


def test_a_full_disk_is_said_as_itself_and_exits_2(capsys):
    with mock.patch.object(processes.tempfile, "mkdtemp", side_effect=OSError(errno.ENOSPC, "No space left on device")):
        assert supervise(CFG) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kvgate: startup error: cannot create the worker processes' run directory in {TMP} (No space left on device)"]


def test_a_port_in_use_is_still_cannot_listen(capsys):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert supervise(validate({"workers": 2, "state_backend": "redis", "port": port})) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kvgate: startup error: cannot listen on 127.0.0.1:{port} (Address already in use): another process listens "
        f"there: stop it, or choose another --port"]
