"""``kvgate engine start``: the launcher prints the engine's URL and served model name, and killing the launcher
(SIGTERM, or SIGKILL where no handler runs) ends the engine's every process and frees its port; ``kvgate engine
stop`` then finds nothing left to stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from kvgate.tools import engine_command, procs
from kvgate.tools import sglang_engine as eng

from .conftest import START_TIMEOUT_S


def _group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (from /proc)."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = open(f"/proc/{entry.name}/stat").read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_killing_the_launcher_stops_its_engine_and_frees_the_port(tmp_path, sig):
    reason = eng.unavailable_reason()
    if reason:
        pytest.skip(f"real SGLang engine not available: {reason}")
    run = tmp_path / "run"
    env = {"KVGATE_ENGINE_RUN_DIR": str(run)}
    port = procs.free_port()
    log = tmp_path / "launcher.log"
    with open(log, "wb") as err:  # stdout a pipe: its lines are the event the test waits on
        popen = subprocess.Popen([sys.executable, "-m", "kvgate", "engine", "start", "--port", str(port),
                                  "--timeout-s", str(START_TIMEOUT_S)], stdout=subprocess.PIPE, stderr=err,
                                 stdin=subprocess.DEVNULL, start_new_session=True, text=True,
                                 env={**os.environ, **env})
    launcher = procs.Proc("launcher", popen, log)
    try:
        lines = []
        for line in popen.stdout:  # until the launcher says every engine serves (EOF: it exited)
            lines.append(line)
            if "engine(s) serving" in line:
                break
        assert lines and "engine(s) serving" in lines[-1], f"{lines}\n{launcher.log_tail()}"
        assert lines[0].startswith(f"engine http://127.0.0.1:{port} ready in ")
        assert "served model kvgate-tiny, KV pool 4000 tokens" in lines[0]
        rec = json.loads((run / f"engine-{port}.json").read_text())
        assert (rec["model"], rec["launcher_pid"], rec["url"]) == ("kvgate-tiny", popen.pid,
                                                                    f"http://127.0.0.1:{port}")
        engine_group = _group(rec["engine_pid"])
        assert len(engine_group) >= 2  # the server and its scheduler (and detokenizer) processes

        os.kill(popen.pid, sig)  # the launcher alone, not its process group
        popen.wait(timeout=120)
        for pid in engine_group:  # each process of the engine ends (pidfd: these are not our children)
            assert engine_command._wait_gone(pid, 60), f"engine process {pid} still runs"
        assert _group(rec["engine_pid"]) == []
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with socket.socket() as s:  # free again: a server can listen there (SO_REUSEADDR, as servers bind: the
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # test's own closed calls sit in TIME_WAIT)
            s.bind(("127.0.0.1", port))
            s.listen()
        assert (run / f"engine-{port}.json").exists() == (sig == signal.SIGKILL)  # SIGTERM cleans up
        out = subprocess.run([sys.executable, "-m", "kvgate", "engine", "stop"], capture_output=True, text=True,
                             env={**os.environ, **env}, timeout=120)
        assert out.returncode == 0
        if sig == signal.SIGKILL:
            assert f"engine http://127.0.0.1:{port}: already gone" in out.stdout
        else:
            assert "no engine started by `kvgate engine start` runs" in out.stdout
        assert list(run.glob("engine-*.json")) == []
    finally:
        launcher.stop(10)


def test_detach_returns_once_the_engine_serves_and_stop_ends_it(tmp_path):
    """``start --detach`` returns with the engine serving and its launcher in the background; ``list`` shows it;
    ``stop`` ends the launcher, which ends the engine's every process, and frees the port."""
    reason = eng.unavailable_reason()
    if reason:
        pytest.skip(f"real SGLang engine not available: {reason}")
    run = tmp_path / "run"
    env = {**os.environ, "KVGATE_ENGINE_RUN_DIR": str(run)}
    port = procs.free_port()

    def kvgate(*argv):
        return subprocess.run([sys.executable, "-m", "kvgate", "engine", *argv], capture_output=True, text=True,
                              env=env, timeout=START_TIMEOUT_S + 120)
    out = kvgate("start", "--detach", "--port", str(port), "--timeout-s", str(START_TIMEOUT_S))
    rec = json.loads((run / f"engine-{port}.json").read_text()) if out.returncode == 0 else {}
    try:
        assert out.returncode == 0, out.stdout + out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == (f"engine http://127.0.0.1:{port} ready: served model kvgate-tiny, KV pool 4000 tokens, "
                            f"log {rec['log']}")
        assert lines[1].startswith(f"kvgate engine: launcher pid {rec['launcher_pid']} in the background")
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # serving after start returned
        listed = kvgate("list").stdout
        assert f"engine http://127.0.0.1:{port}: served model kvgate-tiny" in listed and "running" in listed
        engine_group = _group(rec["engine_pid"])
        stopped = kvgate("stop", "--port", str(port))
        assert stopped.stdout == f"engine http://127.0.0.1:{port}: stopped by its launcher (pid {rec['launcher_pid']})\n"
        for pid in [rec["launcher_pid"], *engine_group]:
            assert engine_command._wait_gone(pid, 60), f"process {pid} still runs"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert list(run.glob("engine-*.json")) == []
    finally:
        if rec:
            engine_command.stop_record({**rec, "_path": str(run / f"engine-{port}.json")})
