"""Does SGLang's prefill/decode (PD) mode run on this CPU? One prefill and one decode engine (the tiny model, as
the real-engine tests start them), the real smg PD router in front, three turns of one session and a close on
both workers. Prints what happened; docs/real-engines.md records the result for SGLang 0.5.23.

    KVGATE_ENGINE_VENV=.venv-engine flock /tmp/kvgate-heavy.lock \
        python scripts/probe_real_pd.py --backend mooncake --pythonpath DIR --ld-library-path DIR1:DIR2

--backend: SGLang's --disaggregation-transfer-backend (fake, mooncake, nixl, ...). --pythonpath: where the
transfer engine's Python package is (pip install --target DIR mooncake-transfer-engine-non-cuda);
--ld-library-path: the shared libraries it needs (libibverbs1, libnl-3-200, libnl-route-3-200 unpacked with
apt-get download + dpkg -x). Mooncake runs over TCP here (MOONCAKE_PROTOCOL=tcp). Two engines: run it alone.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvgate.tools import procs
from kvgate.tools.sglang_engine import STANDIN_DIR, EngineSpec, start_engine


def _post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, OSError) as e:
        return 0, repr(e)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="mooncake")
    ap.add_argument("--pythonpath", default="")
    ap.add_argument("--ld-library-path", default="")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvgate-real-pd-"))
    env = {"PYTHONPATH": ":".join(filter(None, [str(STANDIN_DIR), args.pythonpath]))}
    if args.ld_library_path:
        env["LD_LIBRARY_PATH"] = args.ld_library_path
    if args.backend == "mooncake":
        env["MOONCAKE_PROTOCOL"] = "tcp"
    bport = procs.free_port()
    common = ["--disaggregation-transfer-backend", args.backend]
    started = []
    try:
        t0 = time.monotonic()
        pre = start_engine(EngineSpec(extra=["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                             str(bport), *common], env=env), log_dir, name="pd-prefill")
        started.append(pre)
        print(f"prefill worker up in {time.monotonic() - t0:.0f} s", flush=True)
        dec = start_engine(EngineSpec(extra=["--disaggregation-mode", "decode",
                                             "--disaggregation-decode-enable-radix-cache", *common], env=env),
                           log_dir, name="pd-decode")
        started.append(dec)
        print(f"decode worker up in {time.monotonic() - t0:.0f} s", flush=True)
        port, mport = procs.free_port(), procs.free_port()
        router = procs.start("pd-router", procs.smg_pd_command(port, [(pre.url, bport)], [dec.url], mport), log_dir,
                             url=f"http://127.0.0.1:{port}")
        started.append(router)
        procs.wait_http(router.url + "/readiness", 90, router, procs.router_ready(2))
        ids = list(range(10, 210))
        for turn in range(3):
            status, text = _post(router.url + "/generate", {"input_ids": ids, "session_id": "real-pd",
                                                            "sampling_params": {"max_new_tokens": 8,
                                                                                "ignore_eos": True}})
            print(f"turn {turn}: {status} {text[:300]}", flush=True)
            if status != 200:
                return 1
            out = json.loads(text)
            ids = ids + out["output_ids"] + [77] * 20
        for url in (pre.url, dec.url):
            print("close", url, *_post(url + "/close_session", {"session_id": "real-pd"}), flush=True)
        return 0
    except (RuntimeError, TimeoutError) as e:  # an engine or the router did not start: say why
        print(f"failed: {str(e)[-3000:]}", flush=True)
        return 1
    finally:
        for p in reversed(started):
            p.stop()
        print(f"logs: {log_dir}")


if __name__ == "__main__":
    raise SystemExit(main())
