"""A host:port kvgate cannot listen on is a startup error of its own (the config is valid; the machine refuses
it), one line naming host:port, the system's words and what to do, said before kvgate talks to the router."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
from pathlib import Path

from kvgate.proxy.bootstrap import listen_error

ROOT = Path(__file__).resolve().parent.parent


def test_the_line_names_host_port_the_systems_words_and_what_to_do():
    assert listen_error("127.0.0.1", 8080, errno.EADDRINUSE) == (
        "kvgate: startup error: cannot listen on 127.0.0.1:8080 (Address already in use): another process listens "
        "there: stop it, or choose another --port")
    assert listen_error("::1", 80, errno.EACCES) == (
        "kvgate: startup error: cannot listen on [::1]:80 (Permission denied): a port below 1024 needs root (or "
        "CAP_NET_BIND_SERVICE): choose another --port")
    assert listen_error("10.99.99.99", 0, errno.EADDRNOTAVAIL).endswith(
        "(Cannot assign requested address): no interface of this machine has that address: choose another --host")
    assert listen_error("h", 1, errno.ENOBUFS) == \
        "kvgate: startup error: cannot listen on h:1 (No buffer space available)"


def test_a_port_held_by_a_real_socket_is_not_called_a_config_error():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for argv in (["serve", "--port", str(port)], ["serve", "--port", str(port), "--http-server", "aiohttp"]):
            res = subprocess.run([sys.executable, "-m", "kvgate", *argv, "--upstream", "http://127.0.0.1:9"],
                                 capture_output=True, text=True, cwd=ROOT, timeout=120)
            assert (res.returncode, res.stderr.splitlines()) == (2, [
                f"kvgate: startup error: cannot listen on 127.0.0.1:{port} (Address already in use): another "
                f"process listens there: stop it, or choose another --port"]), res.stderr
            assert "config error" not in res.stderr
        # check-config does not bind: the config itself is fine
        res = subprocess.run([sys.executable, "-m", "kvgate", "check-config", "--port", str(port)],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert (res.returncode, res.stderr) == (0, "")
