"""The program policy's decision cost at fleet scale: microseconds per call of ProgramCoordinator, in process.

No I/O, no network: a ProgramCoordinator (the defaults kvgate serves with) over a Ledger of ENGINES engines of
TOKENS tokens each, driven by an event loop with an injected clock. PROGRAMS agent programs (GRPO groups of 8
sharing a first prompt) start over the first 20 s; each runs 2-8 turns with random prompt growth, random outputs
and heavy-tailed tool gaps, its calls placed on an engine by kvgate (movable; a program admission moved goes on
to its new engine, as kvgate's placement sends it), so the fleet fills: turns wait, programs pause and resume.
Prompts are chain-hashed as kvgate's are: no block repeats. Most programs close their session after their last
turn; the rest just stop (ended: paused when overdue, dropped at the TTL). The loop calls what kvgate's gate
calls: submit (and a pump when it waits), release (which pumps), take_actions, next_deadline after every call
and a pump when that deadline comes, and a capacity snapshot every 2 s.

Reports p50/p99/max microseconds (wall, time.perf_counter_ns) per call: submit, release (incl. its pump), the
timer's pump, next_deadline, reconcile; then a second identical run under tracemalloc for the peak of what the
coordinator and the ledger allocate (the workload's prompts are built before tracing starts). The line of counts
ends with a digest of every decision, pause and final counter, in order: two trees whose digests match decided
alike (the timings do not enter it: the clock is the injected one).

    python scripts/bench_program_decisions.py [--engines 64] [--programs 4096] [--seed 1] [--out FILE.json]
        [--no-memory] [--baseline DIR]

With ``--baseline DIR`` (another source tree, e.g. ``git worktree add /tmp/base main``) both trees' coordinators
run in one process, in lockstep: each call made on both, back to back, the order alternating, so a before/after
is timed at the same moments of a machine whose speed drifts from one run to the next (on a shared 2-core VM the
p50 of the same code moved by half between runs). Their decisions must be the same, call by call.
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
            n = len(blocks)  # chain hashes never repeat: each block names its position (read once, not as it grows)
            blocks.extend(((1 << 62) | (i << 24) | (n + k)) for k in range(grow // BLOCK))
            prompt += grow
        out.append(Prog(f"s{i}", engines[i % len(engines)], rng.uniform(0.0, 20.0), turns, rng.random() < 0.7))
    return out


class Arm:
    """One tree's coordinator: its own ledger, timings and digest. ``mods``: that tree's kvgate modules."""

    def __init__(self, name: str, mods: dict, engines: list[str], tokens: int) -> None:
        self.name, self.engines, self.tokens = name, engines, tokens
        self.Capacity, self.Snapshot = mods["capacity"].EngineCapacity, mods["capacity"].ClusterSnapshot
        self.ledger = mods["ledger"].Ledger()
        self.co = mods["program"].ProgramCoordinator(self.ledger)  # kvgate's defaults: victim ahead, resume fifo
        self.calls: dict[str, list[int]] = {k: [] for k in CALLS}
        self.digest = hashlib.sha256()  # every decision and pause, in order: two trees decide alike iff it matches

    def snapshot(self, now: float):
        return self.Snapshot.build({u: self.Capacity.from_pools([(self.tokens, 0, 0.0)]) for u in self.engines}, now)

    def note(self, call: str, decisions) -> list[str]:
        """Each decision as the digest reads it (ticket, kind, tokens, wait, reason, where, charge, forced)."""
        out = []
        for d in decisions:
            lease = d.lease
            out.append(repr((call, d.ticket, d.kind.value, d.tokens, d.waited_s, d.reason, lease and lease.place,
                             lease and lease.charged, lease and lease.forced)))
            self.digest.update(out[-1].encode())
        return out


CALLS = ("submit", "release", "pump", "next_deadline", "reconcile")


def load_trees(baseline: str | None) -> list[tuple[str, dict]]:
    """This tree's kvgate modules, and with ``baseline`` (a source tree: a git worktree of another commit) that
    tree's too, imported under the same names after this tree's are set aside (each keeps its own globals)."""
    import importlib
    import sys

    names = ("capacity", "ledger", "program")

    def load() -> dict:
        return {n: importlib.import_module(f"kvgate.admission.{n}") for n in names}

    trees = [("this", load())]
    if baseline:
        for k in [k for k in sys.modules if k == "kvgate" or k.startswith("kvgate.")]:
            del sys.modules[k]
        sys.path.insert(0, baseline)
        trees.insert(0, ("base", load()))
        if trees[0][1]["program"].__file__ == trees[1][1]["program"].__file__:
            raise SystemExit(f"--baseline {baseline}: no kvgate package there")
    return trees


def run(progs: list[Prog], engines: list[str], tokens: int, trees: list[tuple[str, dict]]) -> list[Arm]:
    """Drive one coordinator per tree through the workload in lockstep: every call made on each, back to back,
    the order alternating call by call (neither tree always runs first on warm caches), so both are timed at the
    same moments of the machine. The first tree's decisions drive the loop; every other's must be the same
    (else SystemExit: the trees decide differently, and their timings would not compare like for like)."""
    clock = time.perf_counter_ns
    arms = [Arm(name, mods, engines, tokens) for name, mods in trees]
    flip = [0]

    def each(call: str, fn, record: bool = True) -> list:
        """fn(arm) on every arm, timed; returns what each returned (in the arms' order)."""
        flip[0] ^= 1
        order = arms if flip[0] else arms[::-1]
        out = {}
        for a in order:
            t0 = clock()
            out[a.name] = fn(a)
            if record:
                a.calls[call].append(clock() - t0)
        return [out[a.name] for a in arms]

    def agree(call: str, results: list) -> list:
        """Record each arm's decisions; the first arm's, checked against the others'."""
        seen = [a.note(call, r if isinstance(r, list) else (r,)) for a, r in zip(arms, results)]
        if any(s != seen[0] for s in seen[1:]):
            raise SystemExit(f"the trees decided differently at {call} (t={now:.3f} s): {seen}")
        return results[0] if isinstance(results[0], list) else [results[0]]

    for a in arms:
        a.co.reconcile(a.snapshot(0.0), 0.0)
    ev: list = []  # (time, seq, kind, payload)
    seq = 0

    def push(at: float, kind: str, payload) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(ev, (at, seq, kind, payload))

    for p in progs:
        push(p.start, "turn", p)
    push(POLL_S, "poll", None)
    running: dict[str, tuple[Prog, Turn]] = {}  # ticket -> the turn it carries
    waiting: dict[str, tuple[Prog, Turn]] = {}
    timer = [None]  # the one armed timer's time
    n_ticket = 0
    left = len(progs)  # programs with turns still to come
    most_waiting = pauses = 0
    now = 0.0

    def follow(p: Prog, d) -> None:
        """kvgate's placement sends a session where admission moved it from then on (sticky)."""
        if d.lease is not None and d.lease.place != p.engine:
            p.engine = d.lease.place

    def started(decisions) -> None:
        for d in decisions:
            p, t = waiting.pop(d.ticket)
            running[d.ticket] = (p, t)
            follow(p, d)
            push(now + t.decode_s, "done", d.ticket)

    def after() -> None:
        nonlocal pauses, most_waiting
        acts = [a.co.take_actions() for a in arms]
        reprs = [repr([(x.kind, x.session_id, x.place) for x in act]) for act in acts]
        if any(r != reprs[0] for r in reprs[1:]):
            raise SystemExit(f"the trees paused differently at t={now:.3f} s")
        for a, r in zip(arms, reprs):
            a.digest.update(r.encode())
        pauses += sum(x.kind == "close" for x in acts[0])
        most_waiting = max(most_waiting, arms[0].co.waiting)
        nd = each("next_deadline", lambda a: a.co.next_deadline(now))[0]
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
            d = agree("submit", each("submit", lambda a: a.co.submit(
                ticket, t.prompt + MAX_NEW, False, now, place=p.engine, blocks=t.blocks, session_id=p.sid,
                prompt_tokens=t.prompt, movable=True)))[0]
            if d.kind.value == "wait":
                waiting[ticket] = (p, t)
                started(agree("pump", each("pump", lambda a: a.co.pump(now), record=False)))  # as a turn waits
            else:
                running[ticket] = (p, t)
                follow(p, d)
                push(now + t.decode_s, "done", ticket)
        elif kind == "done":
            p, t = running.pop(payload)
            meta = {"prompt_tokens": t.prompt, "completion_tokens": t.output, "cached_tokens": 0}
            started(agree("release", each("release", lambda a: a.co.release(payload, now, meta))))
            p.done += 1
            if p.done < len(p.turns):
                push(now + t.gap_s, "turn", p)
            else:
                left -= 1
                if p.closes:
                    each("forget", lambda a: a.co.forget(p.sid, now), record=False)
        elif kind == "timer":
            if payload != timer[0]:
                continue  # a later call armed an earlier one
            timer[0] = None
            started(agree("timer", each("pump", lambda a: a.co.pump(now))))
        else:  # the capacity poll
            started(agree("reconcile", each("reconcile", lambda a: a.co.reconcile(a.snapshot(now), now))))
            if left or running or waiting or arms[0].co.next_deadline(now) is not None:  # until every program ended
                push(now + POLL_S, "poll", None)
        after()
    for a in arms:
        co = a.co
        a.refused = a.ledger.stats(now)["refused"]
        a.digest.update(repr((sorted(co.counters.items()), a.refused, a.ledger.reserved)).encode())
        a.result = {"digest": a.digest.hexdigest()[:16], "turns": n_ticket, "most_waiting": most_waiting,
                    "pauses": pauses, "sim_s": now, "counters": dict(co.counters)}
    return arms


def pct(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * len(xs))) - 1))] / 1000.0 if xs else 0.0


def diff_counters(arms: list[Arm]) -> str:
    """The final counters and ledger refusals that differ between two arms: 'name before -> after, ...'."""
    (a, b) = arms
    def figures(arm):
        return {**arm.result["counters"], **{f"refused {k}": v for k, v in arm.refused.items()}}
    fa, fb = figures(a), figures(b)
    return ", ".join(f"{k} {fa.get(k, 0):,} -> {fb.get(k, 0):,}" for k in sorted(set(fa) | set(fb))
                     if fa.get(k, 0) != fb.get(k, 0)) or "none"


def tree_name(path: str) -> str:
    """A baseline tree as the report names it: its git commit when it is a git tree, else its directory's name (not
    the path: a report saved with the docs names no directory of the machine it ran on)."""
    import subprocess
    from pathlib import Path

    try:
        r = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
    except (OSError, subprocess.SubprocessError):
        r = None
    return f"commit {r.stdout.strip()}" if r is not None and r.returncode == 0 else Path(path).resolve().name


def rows_of(arm: Arm) -> dict:
    return {k: {"calls": len(v), "p50_us": pct(v, 0.5), "p99_us": pct(v, 0.99), "max_us": max(v) / 1000.0 if v else 0.0}
            for k, v in arm.calls.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=200_000, help="max_total_num_tokens of each engine")
    ap.add_argument("--programs", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--baseline", metavar="DIR", help="another source tree (a git worktree): both run in lockstep, "
                    "timed call by call at the same moments; the report gives both")
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc run")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    engines = [f"http://10.0.{i // 250}.{i % 250}:30000" for i in range(args.engines)]
    trees = load_trees(args.baseline)
    wall = time.perf_counter()
    arms = run(workload(engines, args.programs, args.seed), engines, args.tokens, trees)
    took = time.perf_counter() - wall
    res, c = arms[-1].result, arms[-1].result["counters"]
    report = {"engines": args.engines, "tokens_per_engine": args.tokens, "programs": args.programs, "seed": args.seed,
              "turns": res["turns"], "simulated_s": round(res["sim_s"], 1), "run_s": round(took, 2),
              "most_waiting": res["most_waiting"], "pauses": res["pauses"],
              "waited": c.get("wait", 0), "resumed": c.get("resume", 0), "moved": c.get("moved", 0),
              "decisions_sha256": res["digest"], "python": platform.python_version(), "calls": rows_of(arms[-1])}
    if args.baseline:
        report["baseline"] = {"tree": tree_name(args.baseline), "decisions_sha256": arms[0].result["digest"],
                              "calls": rows_of(arms[0])}
    if not args.no_memory:
        progs = workload(engines, args.programs, args.seed)
        tracemalloc.start()
        r2 = run(progs, engines, args.tokens, trees[-1:])
        report["tracemalloc_peak_mib"] = round(tracemalloc.get_traced_memory()[1] / 2 ** 20, 1)
        tracemalloc.stop()
        del r2
    print(f"{args.programs} programs on {args.engines} engines x {args.tokens:,} tokens: {res['turns']:,} turns over "
          f"{report['simulated_s']} simulated s in {report['run_s']} s; at most {res['most_waiting']:,} waiting, "
          f"{res['pauses']:,} pauses, {report['waited']:,} waits, {report['moved']:,} moved; decisions {res['digest']}")
    if args.baseline:
        base, this = report["baseline"]["calls"], report["calls"]
        same = report["baseline"]["decisions_sha256"] == res["digest"]
        print(f"baseline {args.baseline}: decisions {report['baseline']['decisions_sha256']} (the same call by call"
              f"{'' if same else '; the final counters differ: ' + diff_counters(arms)}); before -> after, timed in "
              "lockstep")
        print(f"{'call':<14}{'calls':>9}{'p50 us':>18}{'p99 us':>20}{'max us':>22}")
        for k, r in this.items():
            b0 = base[k]
            print(f"{k:<14}{r['calls']:>9,}{b0['p50_us']:>9.1f} ->{r['p50_us']:>6.1f}{b0['p99_us']:>10.1f} ->"
                  f"{r['p99_us']:>7.1f}{b0['max_us']:>11.1f} ->{r['max_us']:>8.1f}")
    else:
        print(f"{'call':<14}{'calls':>9}{'p50 us':>10}{'p99 us':>10}{'max us':>11}")
        for k, r in report["calls"].items():
            print(f"{k:<14}{r['calls']:>9,}{r['p50_us']:>10.1f}{r['p99_us']:>10.1f}{r['max_us']:>11.1f}")
    if "tracemalloc_peak_mib" in report:
        print(f"tracemalloc peak (coordinator + ledger + the loop's events): {report['tracemalloc_peak_mib']} MiB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

if __name__ == "__main__":
    main()
