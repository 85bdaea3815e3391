"""The program policy's decision cost at fleet scale: microseconds per call of ProgramCoordinator, in process.

No I/O, no network: a ProgramCoordinator (the defaults kvgate serves with) over a Ledger of ENGINES engines of
TOKENS tokens each, driven by an event loop with an injected clock. PROGRAMS agent programs (GRPO groups of 8
sharing a first prompt) start over the first 20 s; each runs 2-8 turns with random prompt growth, random outputs
and heavy-tailed tool gaps, its calls placed on an engine by kvgate (movable), so the fleet fills: turns wait,
programs pause and resume. Most programs close their session after their last turn; the rest just stop (ended:
paused when overdue, dropped at the TTL). The loop calls what kvgate's gate calls: submit (and a pump when it
waits), release (which pumps), take_actions, next_deadline after every call and a pump when that deadline
comes, and a capacity snapshot every 2 s.

Reports p50/p99/max microseconds (wall, time.perf_counter_ns) per call: submit, release (incl. its pump), the
timer's pump, next_deadline, reconcile; then a second identical run under tracemalloc for the peak of what the
coordinator and the ledger allocate (the workload's prompts are built before tracing starts). The line of counts
ends with a digest of every decision, pause and final counter, in order: two trees whose digests match decided
alike (the timings do not enter it: the clock is the injected one).

    python scripts/bench_program_decisions.py [--engines 64] [--programs 4096] [--seed 1] [--out FILE.json]
        [--no-memory]
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import platform
import random
import time
import tracemalloc
from dataclasses import dataclass, field

from kvgate.admission.capacity import ClusterSnapshot, EngineCapacity
from kvgate.admission.coordinator import Kind
from kvgate.admission.ledger import Ledger
from kvgate.admission.program import ProgramCoordinator

BLOCK = 64  # the ledger's prefix block size, tokens
GROUP = 8  # programs per GRPO group (the same first prompt)
MAX_NEW = 1024  # each call's decode budget, tokens
POLL_S = 2.0  # the capacity poll interval


@dataclass
class Turn:
    prompt: int  # tokens
    blocks: tuple  # the prompt's prefix block hashes (chained: a shared prefix has equal hashes)
    output: int  # tokens the answer carries
    decode_s: float  # how long the engine takes
    gap_s: float  # the tool call after it


@dataclass
class Prog:
    sid: str
    engine: str
    start: float
    turns: list[Turn]
    closes: bool  # closes its session after its last turn (else it just stops)
    done: int = 0
    tickets: list = field(default_factory=list)


def workload(engines: list[str], programs: int, seed: int) -> list[Prog]:
    """The programs, every turn's prompt and block hashes built up front (so tracing sees the policy only)."""
    rng = random.Random(seed)
    out = []
    group_first: dict[int, int] = {}
    for i in range(programs):
        g = i // GROUP
        first = group_first.setdefault(g, rng.randint(500, 4000))
        blocks = [(g << 40) | k for k in range(first // BLOCK)]  # the group's shared first prompt
        prompt, turns = first, []
        for t in range(rng.randint(2, 8)):
            output = rng.randint(50, 600)
            gap = rng.lognormvariate(1.0, 1.0) if rng.random() > 0.1 else rng.uniform(30.0, 120.0)
            turns.append(Turn(prompt, tuple(blocks), output, 0.5 + output * 0.02, gap))
            grow = output + rng.randint(100, 1500)  # its answer and the tool's result join the next prompt
            blocks.extend(((1 << 62) | (i << 24) | (len(blocks) + k)) for k in range(grow // BLOCK))
            prompt += grow
        out.append(Prog(f"s{i}", engines[i % len(engines)], rng.uniform(0.0, 20.0), turns, rng.random() < 0.7))
    return out


def snapshot(engines: list[str], tokens: int, now: float) -> ClusterSnapshot:
    return ClusterSnapshot.build({u: EngineCapacity.from_pools([(tokens, 0, 0.0)]) for u in engines}, now)


def run(progs: list[Prog], engines: list[str], tokens: int) -> dict:
    """Drive one coordinator through the workload; returns {call: [ns, ...]} and a few counts."""
    clock = time.perf_counter_ns
    calls: dict[str, list[int]] = {k: [] for k in ("submit", "release", "pump", "next_deadline", "reconcile")}
    ledger = Ledger()
    co = ProgramCoordinator(ledger)  # kvgate's defaults: victim ahead, resume fifo, reclaim after 2 s
    co.reconcile(snapshot(engines, tokens, 0.0), 0.0)
    ev: list = []  # (time, seq, kind, payload)
    seq = 0

    def push(at: float, kind: str, payload) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(ev, (at, seq, kind, payload))

    for p in progs:
        push(p.start, "turn", p)
    push(POLL_S, "poll", None)
    digest = hashlib.sha256()  # every decision and pause, in order: two trees decide alike iff the digests match

    def note(call: str, decisions) -> None:
        for d in decisions:
            lease = d.lease
            digest.update(repr((call, d.ticket, d.kind.value, d.tokens, d.waited_s, d.reason, lease and lease.place,
                                lease and lease.charged, lease and lease.forced)).encode())

    running: dict[str, tuple[Prog, Turn]] = {}  # ticket -> the turn it carries
    waiting: dict[str, tuple[Prog, Turn]] = {}
    timer = [None]  # the one armed timer's time
    n_ticket = 0
    left = len(progs)  # programs with turns still to come
    most_waiting = pauses = 0

    def started(decisions) -> None:
        for d in decisions:
            p, t = waiting.pop(d.ticket)
            running[d.ticket] = (p, t)
            push(now + t.decode_s, "done", d.ticket)

    def after() -> None:
        nonlocal pauses, most_waiting
        acts = co.take_actions()
        pauses += len(acts)
        digest.update(repr([(a.kind, a.session_id, a.place) for a in acts]).encode())
        most_waiting = max(most_waiting, co.waiting)
        t0 = clock()
        nd = co.next_deadline(now)
        calls["next_deadline"].append(clock() - t0)
        if nd is not None and (timer[0] is None or nd < timer[0] or timer[0] < now):
            timer[0] = nd + 1e-3 if nd <= now else nd  # the gate's timer sleeps at least 1 ms past it
            push(timer[0], "timer", timer[0])

    while ev:
        now, _, kind, payload = heapq.heappop(ev)
        if kind == "turn":
            p = payload
            t = p.turns[p.done]
            n_ticket += 1
            ticket = f"t{n_ticket}"
            t0 = clock()
            d = co.submit(ticket, t.prompt + MAX_NEW, False, now, place=p.engine, blocks=t.blocks,
                          session_id=p.sid, prompt_tokens=t.prompt, movable=True)
            calls["submit"].append(clock() - t0)
            note("submit", (d,))
            if d.kind is Kind.WAIT:
                waiting[ticket] = (p, t)
                out = co.pump(now)  # the gate pumps once as a turn starts to wait
                note("pump", out)
                started(out)
            else:
                running[ticket] = (p, t)
                push(now + t.decode_s, "done", ticket)
        elif kind == "done":
            p, t = running.pop(payload)
            meta = {"prompt_tokens": t.prompt, "completion_tokens": t.output, "cached_tokens": 0}
            t0 = clock()
            out = co.release(payload, now, meta)
            calls["release"].append(clock() - t0)
            note("release", out)
            started(out)
            p.done += 1
            if p.done < len(p.turns):
                push(now + t.gap_s, "turn", p)
            else:
                left -= 1
                if p.closes:
                    co.forget(p.sid, now)
        elif kind == "timer":
            if payload != timer[0]:
                continue  # a later call armed an earlier one
            timer[0] = None
            t0 = clock()
            out = co.pump(now)
            calls["pump"].append(clock() - t0)
            note("timer", out)
            started(out)
        else:  # the capacity poll
            t0 = clock()
            out = co.reconcile(snapshot(engines, tokens, now), now)
            calls["reconcile"].append(clock() - t0)
            note("reconcile", out)
            started(out)
            if left or running or waiting or co.next_deadline(now) is not None:  # until every program ended
                push(now + POLL_S, "poll", None)
        after()
    digest.update(repr((sorted(co.counters.items()), ledger.stats(now)["refused"], ledger.reserved)).encode())
    return {"digest": digest.hexdigest()[:16], "calls": calls, "turns": n_ticket, "most_waiting": most_waiting, "pauses": pauses,
            "sim_s": now, "counters": dict(co.counters), "coordinator": co}


def pct(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * len(xs))) - 1))] / 1000.0 if xs else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=200_000, help="max_total_num_tokens of each engine")
    ap.add_argument("--programs", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc run")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    engines = [f"http://10.0.{i // 250}.{i % 250}:30000" for i in range(args.engines)]
    wall = time.perf_counter()
    res = run(workload(engines, args.programs, args.seed), engines, args.tokens)
    took = time.perf_counter() - wall
    rows = {k: {"calls": len(v), "p50_us": pct(v, 0.5), "p99_us": pct(v, 0.99), "max_us": max(v) / 1000.0 if v else 0.0}
            for k, v in res["calls"].items()}
    c = res["counters"]
    report = {"engines": args.engines, "tokens_per_engine": args.tokens, "programs": args.programs, "seed": args.seed,
              "turns": res["turns"], "simulated_s": round(res["sim_s"], 1), "run_s": round(took, 2),
              "most_waiting": res["most_waiting"], "pauses": res["pauses"],
              "waited": c.get("wait", 0), "resumed": c.get("resume", 0), "moved": c.get("moved", 0),
              "decisions_sha256": res["digest"], "python": platform.python_version(), "calls": rows}
    if not args.no_memory:
        progs = workload(engines, args.programs, args.seed)
        tracemalloc.start()
        r2 = run(progs, engines, args.tokens)
        report["tracemalloc_peak_mib"] = round(tracemalloc.get_traced_memory()[1] / 2 ** 20, 1)
        tracemalloc.stop()
        del r2
    print(f"{args.programs} programs on {args.engines} engines x {args.tokens:,} tokens: {res['turns']:,} turns over "
          f"{report['simulated_s']} simulated s in {report['run_s']} s; at most {res['most_waiting']:,} waiting, "
          f"{res['pauses']:,} pauses, {report['waited']:,} waits, {report['moved']:,} moved; decisions {res['digest']}")
    print(f"{'call':<14}{'calls':>9}{'p50 us':>10}{'p99 us':>10}{'max us':>11}")
    for k, r in rows.items():
        print(f"{k:<14}{r['calls']:>9,}{r['p50_us']:>10.1f}{r['p99_us']:>10.1f}{r['max_us']:>11.1f}")
    if "tracemalloc_peak_mib" in report:
        print(f"tracemalloc peak (coordinator + ledger + the loop's events): {report['tracemalloc_peak_mib']} MiB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
