"""What admission costs one request in kvgate's process: acquire + release of a small /generate, in process.

No network: a gate (the policy chosen) over a fixed snapshot of ENGINES engines with room to spare, fed the
same parsed request body that kvgate's handler gives it, each request one of PROGRAMS sessions (cycled), placed on
an engine (as kvgate's session placement does), released with the meta_info an answer carries. Prints the CPU time per
acquire + release pair (process time / pairs, microseconds), best of REPEAT runs; --inflight N holds N other
requests' leases meanwhile.

With --waiters N: the coordinator alone, N turns of new programs waiting (the engines full of running turns),
and the CPU time of one pump, the call every release, arrival and timer tick makes while they wait.

    .venv/bin/python scripts/admission_cost.py [--pairs 20000] [--repeat 5] [--policy fifo program]
        [--programs 512 4096] [--inflight 2000] [--waiters 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.gate import AdmissionGate
from kvgate.config import validate
from kvgate.common.admission_seam import RequestInfo
from kvgate.common.classify import classify
from kvgate.common.metrics import Metrics

ENGINES = 4
CAPACITY = 1_000_000  # tokens per engine: nothing waits
META = {"prompt_tokens": 16, "completion_tokens": 16, "cached_tokens": 0}


async def _run(policy: str, pairs: int, programs: int, inflight: int = 0) -> float:
    cfg = validate({"agentic_program_admission": True, "admission_policy": policy})
    urls = [f"http://127.0.0.1:{30000 + i}" for i in range(ENGINES)]
    gate = AdmissionGate(cfg, Metrics(), engine_of=lambda sid: (urls[hash(sid) % ENGINES], None))
    gate.reconcile(ClusterSnapshot.build({u: EngineCapacity.from_pools([(CAPACITY, 0, 0.0)]) for u in urls},
                                         time.monotonic()))
    raw = orjson.dumps({"input_ids": list(range(16)), "sampling_params": {"max_new_tokens": 16}})
    sessions = [f"s{i}" for i in range(programs)]
    c = classify("POST", "/generate", raw)
    held = [await gate.acquire(RequestInfo(c, {}, f"held{i}")) for i in range(inflight)]  # requests in flight
    t0 = time.process_time()
    for i in range(pairs):
        ticket = await gate.acquire(RequestInfo(c, {}, sessions[i % programs]))
        gate.release(ticket, META)
    took = time.process_time() - t0
    for t in held:
        gate.release(t, META)
    return took / pairs * 1e6


def _pump_cost(policy: str, waiters: int, pumps: int = 200) -> float:
    from kvgate.admission.coordinator import AdmissionCoordinator
    from kvgate.admission.ledger import Ledger
    from kvgate.admission.program import ProgramCoordinator
    urls = [f"http://127.0.0.1:{30000 + i}" for i in range(ENGINES)]
    ledger = Ledger(headroom=0.9, pressure_threshold=0.92, stale_after_s=1e9, lease_ttl_s=1e9)
    co = ProgramCoordinator(ledger, max_wait_s=1e6) if policy == "program" else AdmissionCoordinator(ledger, 1e6)
    co.reconcile(ClusterSnapshot.build({u: EngineCapacity.from_pools([(100_000, 0, 0.0)]) for u in urls}, 0.0), 0.0)
    now = 0.0
    for i in range(ENGINES * 85 + waiters):  # 85 turns of 1,000 tokens fill an engine's 90,000-token ceiling
        now += 1e-3
        running = i < ENGINES * 85
        co.submit(f"t{i}", 1000 if running else 5000, False, now, place=urls[i % ENGINES], session_id=f"s{i}",
                  prompt_tokens=500 if running else 4000)
    t0 = time.process_time()
    for _ in range(pumps):
        now += 1e-3
        co.pump(now)
    return (time.process_time() - t0) / pumps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--programs", type=int, nargs="+", default=[512],
                    help="distinct sessions the requests cycle through (live agent programs)")
    ap.add_argument("--policy", nargs="+", default=["fifo", "program"], choices=["fifo", "program"])
    ap.add_argument("--inflight", type=int, default=0, help="requests held in flight while the pairs run")
    ap.add_argument("--waiters", type=int, nargs="*", default=[],
                    help="also time one pump with this many turns waiting")
    args = ap.parse_args()
    for policy in args.policy:
        for n in args.waiters:
            best = min(_pump_cost(policy, n) for _ in range(args.repeat))
            print(f"{policy}, {n} waiting: {best:.0f} us CPU per pump (best of {args.repeat})")
    for policy in args.policy:
        for n in args.programs:
            best = min(asyncio.run(_run(policy, args.pairs, n, args.inflight)) for _ in range(args.repeat))
            print(f"{policy}, {n} programs, {args.inflight} in flight: {best:.1f} us CPU per acquire + release "
                  f"({args.pairs} pairs, best of {args.repeat})")


if __name__ == "__main__":
    main()
