#!/usr/bin/env python3
"""Benchmark of kvgate.sessions.inference: the time inference adds per request, and precision/recall on a
synthetic agentic workload with GRPO groups (target: under 1 ms for a 64K-token prompt).

Prints one line per figure. Timings are the median (and p99) of --reps runs, in milliseconds, measured
with time.perf_counter on this machine; the index holds --sessions other sessions so lookups are not
trivially empty. "infer+start" is what the proxy pays per request (infer, then on_request_start with
the prepared blocks).

usage: python scripts/bench_inference.py [--tokens 65536] [--sessions 10000] [--reps 200]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvgate.sessions.inference import SessionInference, score


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 151_000) for _ in range(n)]


def _ms(samples: list[float]) -> str:
    s = sorted(samples)
    return f"median {statistics.median(s) * 1e3:.3f} ms, p99 {s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3:.3f} ms"


def bench_latency(tokens: int, sessions: int, reps: int, seed: int) -> None:
    rng = random.Random(seed)
    inf = SessionInference(max_sessions=max(sessions + 16, 1))
    # Background: other sessions, each a 2K-token prompt and a 256-token output, all indexed.
    for i in range(sessions):
        p = _ids(rng, 2048)
        r = inf.infer(p, 0.0)
        inf.on_request_start(r.session_id, p, 0.0, r.prepared)
        inf.on_response(r.session_id, _ids(rng, 256), 0.0)
        inf.on_request_end(r.session_id, 0.0)
    # The measured session: a long history of `tokens` ids; the next turn appends its output + 512 ids.
    prompt = _ids(rng, tokens - 2048 - 512)
    r = inf.infer(prompt, 1.0)
    sid = r.session_id
    inf.on_request_start(sid, prompt, 1.0, r.prepared)
    out = _ids(rng, 2048)
    inf.on_response(sid, out, 1.0)
    inf.on_request_end(sid, 1.0)
    nxt = prompt + out + _ids(rng, 512)
    assert len(nxt) == tokens
    t_infer, t_total, t_new = [], [], []
    fresh = _ids(rng, tokens)
    for _ in range(reps):
        t0 = time.perf_counter()
        res = inf.infer(nxt, 2.0)
        t1 = time.perf_counter()
        t_infer.append(t1 - t0)
        assert res.session_id == sid and res.decisive, res
        t0 = time.perf_counter()
        res = inf.infer(nxt, 2.0)
        inf.on_request_start(res.session_id, nxt, 2.0, res.prepared)
        t_total.append(time.perf_counter() - t0)
        # undo: make the prompt the previous one again (not timed)
        inf.on_request_start(sid, prompt, 2.0)
        inf.on_response(sid, out, 2.0)
        inf.on_request_end(sid, 2.0)
        inf.on_request_end(sid, 2.0)
        t0 = time.perf_counter()
        res = inf.infer(fresh, 2.0)
        t_new.append(time.perf_counter() - t0)
        assert res.is_new
    print(f"infer, {tokens}-token prompt continuing a session (decisive), {sessions} other sessions: {_ms(t_infer)}")
    print(f"infer + on_request_start (what the proxy pays per request): {_ms(t_total)}")
    print(f"infer, {tokens}-token prompt of a new session: {_ms(t_new)}")
    text = "".join(chr(rng.randrange(97, 123)) for _ in range(tokens * 4))
    t_text = []
    for _ in range(reps):
        t0 = time.perf_counter()
        inf.infer(text, 2.0)
        t_text.append(time.perf_counter() - t0)
    print(f"infer, text prompt of {len(text)} characters (~{tokens} tokens): {_ms(t_text)}")


def bench_accuracy(groups: int, group_size: int, turns: int, seed: int) -> None:
    """Closed-loop synthetic workload: `groups` tasks x `group_size` GRPO siblings sharing a 2K-token task
    prompt, `turns` turns each, interleaved at random; outputs share their first 32 ids within a group
    (a common opening) then diverge. Reports pairwise precision/recall of inferred vs true sessions."""
    rng = random.Random(seed)
    inf = SessionInference()
    truth, pred = [], []
    live = []
    for g in range(groups):
        task = _ids(rng, 2048)
        opening = _ids(rng, 32)
        for s in range(group_size):
            live.append({"truth": f"g{g}s{s}", "ctx": list(task), "opening": opening, "left": turns})
    now = 0.0
    while live:
        a = live[rng.randrange(len(live))]
        now += 0.01
        r = inf.infer(a["ctx"], now)
        truth.append(a["truth"])
        pred.append(r.session_id)
        inf.on_request_start(r.session_id, a["ctx"], now, r.prepared)
        out = (a["opening"] if a["left"] == turns else []) + _ids(rng, rng.randrange(64, 512))
        inf.on_response(r.session_id, out, now)
        inf.on_request_end(r.session_id, now)
        a["ctx"] = a["ctx"] + out + _ids(rng, rng.randrange(16, 256))
        a["left"] -= 1
        if a["left"] == 0:
            live.remove(a)
    p, rcl = score(pred, truth)
    st = inf.stats()
    print(f"accuracy, {groups} groups x {group_size} siblings x {turns} turns ({len(truth)} requests): "
          f"precision {p:.4f}, recall {rcl:.4f}; decisive {st['decisive']}, new {st['new']}, "
          f"ambiguous {st['ambiguous']}, diverged-excluded {st['diverged']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    bench_latency(args.tokens, args.sessions, args.reps, args.seed)
    bench_accuracy(groups=32, group_size=8, turns=10, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
