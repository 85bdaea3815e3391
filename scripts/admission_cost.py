"""What admission costs one request in kvgate's process: acquire + release of a small /generate, in process.

No network: a gate (the policy chosen) over a fixed snapshot of ENGINES engines with room to spare, fed the
same parsed request body that kvgate's handler gives it, each request a session of PROGRAMS (cycled) placed on an engine
(as kvgate's session placement does), released with the meta_info an answer carries. Prints the CPU time per
acquire + release pair (process time / pairs, microseconds), best of REPEAT runs.

    .venv/bin/python scripts/admission_cost.py [--pairs 20000] [--repeat 5] [--policy fifo program] [--programs 512 4096]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.gate import AdmissionGate
from kvgate.config import validate
from kvgate.proxy.admit import RequestInfo
from kvgate.proxy.classify import classify
from kvgate.proxy.metrics import Metrics

ENGINES = 4
CAPACITY = 1_000_000  # tokens per engine: nothing waits
META = {"prompt_tokens": 16, "completion_tokens": 16, "cached_tokens": 0}


async def _run(policy: str, pairs: int, programs: int) -> float:
    cfg = validate({"agentic_program_admission": True, "admission_policy": policy})
    urls = [f"http://127.0.0.1:{30000 + i}" for i in range(ENGINES)]
    gate = AdmissionGate(cfg, Metrics(), engine_of=lambda sid: (urls[hash(sid) % ENGINES], None))
    gate.reconcile(ClusterSnapshot.build({u: EngineCapacity.from_pools([(CAPACITY, 0, 0.0)]) for u in urls},
                                         time.monotonic()))
    raw = orjson.dumps({"input_ids": list(range(16)), "sampling_params": {"max_new_tokens": 16}})
    sessions = [f"s{i}" for i in range(programs)]
    c = classify("POST", "/generate", raw)
    t0 = time.process_time()
    for i in range(pairs):
        ticket = await gate.acquire(RequestInfo(c, {}, sessions[i % programs]))
        gate.release(ticket, META)
    took = time.process_time() - t0
    return took / pairs * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--programs", type=int, nargs="+", default=[512],
                    help="distinct sessions the requests cycle through (live agent programs)")
    ap.add_argument("--policy", nargs="+", default=["fifo", "program"], choices=["fifo", "program"])
    args = ap.parse_args()
    for policy in args.policy:
        for n in args.programs:
            best = min(asyncio.run(_run(policy, args.pairs, n)) for _ in range(args.repeat))
            print(f"{policy}, {n} programs: {best:.1f} us CPU per acquire + release "
                  f"({args.pairs} pairs, best of {args.repeat})")


if __name__ == "__main__":
    main()
