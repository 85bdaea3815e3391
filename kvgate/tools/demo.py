"""``kvgate demo``: the whole request path on real input, with and without kvgate.

Starts four simulated engines and a real smg router in front of them (each a subprocess in its own process
group) and replays the multi-turn sessions of a slice of the Mooncake conversation trace at their real
timestamps (scaled by --speed): first to smg alone, then, on a fresh fleet, through kvgate in front of the
same smg (``--router-policy``, smg's default cache_aware). Each run prints a summary (kvgate's run closes the
sessions that remain first), and the demo ends with one line saying what kvgate gained (or lost) against smg
alone on the same replay: the prompt tokens the engines computed (not found in their radix caches), the cache hit
rate and the turns' latency. Then it stops everything it started. Sessions come from hash-block chains
(kvgate.bench.trace) and are sent as X-Session-ID, which kvgate turns into a top-level session_id. Turns go as
token ids to /generate, the way RL rollouts (and kvgate bench) send them, and kvgate places the sessions itself
(session_placement: kvgate, docs/placement.md). ``--route completions`` sends text to /v1/completions instead,
and the router places the sessions.

``--engine sglang`` runs the same path on real SGLang engines (CPU, kvgate.tools.sglang_engine; installed by
scripts/setup-engine.sh): two tiny engines, the trace's token counts divided by ``--token-scale`` (32) so a
CPU engine keeps up, and its token ids folded into the tiny model's vocabulary (an id past it crashes SGLang's
scheduler). ``--engine-url`` uses engines already running instead of starting any. A real engine does not say
which session ids and closes it received, so those two reconciliation lines are left out.

Fleet size: the whole trace window brings about 40,000 prompt tokens/s (its multi-turn sessions alone about
18,000); one simulated engine (the default llama-3-8b-h100 profile) prefills about 20,000/s, less for long
prompts. Two engines queue without bound on the whole window (the engines then run their KV pools full, and
admission can only move that queue into kvgate, every request waiting until it ages out); four keep up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import aiohttp
import orjson

from kvgate.tools import procs
from kvgate.bench.report import percentile
from kvgate.bench.trace import (BLOCK_TOKENS, TokenBook, TraceRecord, infer_sessions, iter_turns, read_trace,
                                turn_gaps)

DEFAULT_TRACE = "mooncake_slice.jsonl"
#: The demo's idle close lies above this percentile of the replayed window's gaps between a session's turns: the
#: median. Measured on the shipped slice (three lifecycle runs each, docs/benchmark.md): above the median (100 s)
#: the cache hit was 11.1-11.4% and turn p99 7.1-7.7 s, above the p95 (370 s) 9.4-10.9% and 7.6-8.6 s. A close
#: only drops the session's references on the engines (its KV stays cached until evicted), so a session that comes
#: back after it loses little, while every session that has ended holds its KV against the live ones until closed.
IDLE_GAP_PERCENTILE = 50.0
#: ... rounded up to a multiple of this many seconds (trace time).
IDLE_ROUND_S = 10.0
#: The idle close when the window has no gap at all (no session with two turns): kvgate's default.
IDLE_NO_GAPS_S = 300.0


@dataclass(frozen=True)
class IdleClose:
    """The demo's idle close (trace seconds) and the figures it came from: gaps, the replayed window's gaps
    between a session's turns; median_s and p95_s, their median and 95th percentile;
    longer, the gaps longer than idle_s (each closes its session, which the next turn re-opens)."""

    idle_s: float
    gaps: int
    median_s: float | None
    p95_s: float | None
    longer: int


def idle_close_from_gaps(gaps: list[float], percentile_: float = IDLE_GAP_PERCENTILE,
                         round_s: float = IDLE_ROUND_S) -> IdleClose:
    """The idle close for a replay whose sessions' turns come ``gaps`` seconds apart: the first multiple of
    ``round_s`` above their ``percentile_`` percentile (nearest rank; IDLE_GAP_PERCENTILE says why the median).
    IDLE_NO_GAPS_S without gaps. Pure."""
    if not gaps:
        return IdleClose(IDLE_NO_GAPS_S, 0, None, None, 0)
    q = percentile(gaps, percentile_)
    idle = (q // round_s + 1) * round_s
    return IdleClose(idle, len(gaps), percentile(gaps, 50), percentile(gaps, 95), sum(1 for g in gaps if g > idle))


def idle_line(idle: IdleClose, speed: float, chosen: bool) -> str:
    """The demo's line on its idle close: the figure, where it came from, and what it means at ``speed``;
    ``chosen``: given by --idle-close-s rather than derived. Pure."""
    at = f"{idle.idle_s / speed:g} s at speed {speed:g}"
    if not idle.gaps:
        how = "--idle-close-s" if chosen else "kvgate's default"
        return f"idle close {idle.idle_s:g} s of trace time ({how}; {at}); no session in the window has two turns"
    figures = (f"the window's {idle.gaps} gaps between a session's turns: median {idle.median_s:.0f} s, "
               f"p95 {idle.p95_s:.0f} s; {idle.longer} longer, each a close and a re-open")
    how = "--idle-close-s" if chosen else ("above the median gap" if IDLE_GAP_PERCENTILE == 50
                                           else f"above the p{IDLE_GAP_PERCENTILE:g} gap")
    return f"idle close {idle.idle_s:g} s of trace time ({how}; {at}); {figures}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None,
                   help="trace file (default: the 10-minute Mooncake slice shipped in kvgate/data)")
    p.add_argument("--start-s", type=float, default=0.0, help="where the window starts in the trace, seconds")
    p.add_argument("--duration-s", type=float, default=600.0,
                   help="window length in trace time, seconds (the shipped slice holds 600)")
    p.add_argument("--sessions", choices=("multi-turn", "all"), default="multi-turn",
                   help="multi-turn: only the sessions with two turns or more in the window (what kvgate's session "
                        "lifecycle and placement act on); all: every request of the window")
    p.add_argument("--speed", type=float, default=5.0,
                   help="replay and simulated compute this many times faster (kvgate's idle close scales too)")
    p.add_argument("--engine", choices=("sim", "sglang"), default="sim",
                   help="sim: simulated engines (kvgate sim-engine); sglang: real SGLang engines on the CPU "
                        "(scripts/setup-engine.sh installs them; see docs/real-engines.md)")
    p.add_argument("--engine-url", action="append", default=[], metavar="URL",
                   help="with --engine sglang: a running engine to use instead of starting one (repeat the flag)")
    p.add_argument("--engines", type=int, default=None,
                   help="engines to start (default: 4 simulated, which keep up with the trace's ~40,000 prompt "
                        "tokens/s where two do not; 2 real ones)")
    p.add_argument("--max-total-num-tokens", type=int, default=None,
                   help="KV pool of each engine, tokens (default: 200000 simulated, 8000 real)")
    p.add_argument("--token-scale", type=int, default=None,
                   help="divide the trace's token counts by this (default: 1 simulated, 32 real)")
    p.add_argument("--idle-close-s", type=float, default=None,
                   help="kvgate session_idle_close_s, trace time (default: from the replayed window, above its "
                        "median gap between a session's turns: 100 s on the shipped slice, whose gaps are a median "
                        "96 s; the demo prints it)")
    p.add_argument("--runs", choices=("compare", "all", "smg", "lifecycle", "admission", "both"), default="compare",
                   help="compare: smg alone, then kvgate with session lifecycle; all: those and kvgate with "
                        "program-aware admission too; smg, lifecycle, admission: that run alone; both: lifecycle "
                        "then admission. Each run on a fresh fleet")
    p.add_argument("--router-policy", default="cache_aware",
                   help="smg's --policy in every run (cache_aware: smg's default)")
    p.add_argument("--route", choices=("generate", "completions"), default="generate",
                   help="generate: token ids to /generate, as RL rollouts send them, kvgate placing the sessions "
                        "(session_placement: kvgate); completions: text to /v1/completions, the router placing "
                        "them")
    p.add_argument("--log-dir", default=None, help="where child process logs go (default: a temp dir)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the summary as JSON to this file")


@dataclass
class Replay:
    """What the replay client saw."""

    latencies: list[float] = field(default_factory=list)
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    admission: dict[str, int] = field(default_factory=dict)
    queue_ms: list[float] = field(default_factory=list)


@dataclass
class CloseFigures:
    """What the demo counted about sessions and their closes, from kvgate and from the engines.

    sessions: sessions in the trace window; closed: of those, closed in kvgate's registry at the end;
    closes: kvgate's fan-outs by reason (agentic_kv_session_close_total); session_closes: per session, how
    many times it was closed (the registry's ``closes``); engines: engines each close went to;
    failed_calls: engine calls that failed after retries; engine_closes: /close_session calls each engine
    received; engine_sessions: the session ids each engine saw on a generate call (both None when the engines
    do not report them: real SGLang engines); placed_by: who picked each session's engine ("kvgate" or
    "router"); calls_ok, calls_error: the /close_session calls kvgate sent, by result
    (agentic_kv_session_close_calls_total; None when not known). A call kvgate counts as an error (a timeout)
    may still have reached the engine, and a close kvgate sends again (a retry, or a close asked for again)
    reaches it twice, so an engine receives between the ok calls and all calls sent."""

    sessions: int
    closed: int
    closes: dict[str, int]
    session_closes: list[int]
    engines: int
    failed_calls: int
    engine_closes: list[int] | None
    engine_sessions: list[set[str]] | None
    placed_by: str = "router"
    calls_ok: int | None = None
    calls_error: int | None = None


def _n(count: int, noun: str, plural: str | None = None) -> str:
    """``1 session``, ``2 sessions``."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def router_line(path: str, verdict: str, placed_by: str) -> str:
    """The summary's line on who took each session's turns to an engine, and what the router's probe found.
    Pure."""
    said = {"forwarded": "forwards", "dropped": "drops"}.get(verdict)
    probe = (f"kvgate's probe found the router {said} a top-level session_id on {path}" if said else
             f"kvgate's probe could not tell whether the router keeps a top-level session_id on {path} ({verdict})")
    if placed_by == "kvgate":
        return (f"router     turns sent to {path}; kvgate picked each session's engine and sent its turns there "
                f"itself, past the router (session placement; the router served the other calls). {probe}")
    return (f"router     turns sent to {path}; the router picked each turn's engine (kvgate placed none). {probe}, "
            f"so the engine got each session's id")


def placement_line(counts: dict[str, int]) -> str:
    """The summary's line on kvgate's session placement counts (kvgate.fleet.placement ``counts``). Pure."""
    placed = counts["free_kv"] + counts["prefix"] + counts["reopened"] + counts["replaced"]
    return (f"placement  {_n(placed, 'session placement')} (a session's first turn, or its first turn after a close "
            f"or after its engine left): {counts['free_kv']} on the engine with the most free KV, {counts['prefix']} "
            f"with the engine holding their prompt's prefix, {counts['reopened']} re-opened on their old engine, "
            f"{counts['replaced']} moved off an engine that left; of these, {counts['reopen_elsewhere']} re-opened "
            f"elsewhere (their old engine at the pressure threshold); then {_n(counts['sticky'], 'later turn')} "
            f"went to their session's engine, where its prefix is cached")


def reconcile(f: CloseFigures) -> tuple[list[str], list[str]]:
    """The summary's session, fan-out and engine lines, each sum shown so it can be checked, and the list of
    figures that do not add up (empty when every one does). Pure: no I/O.

    Why two counts differ when nothing is wrong: a session that sends another turn after kvgate closed it for
    being idle is reopened and closed again (one session, two closes); every close goes to every engine (one
    close, one call per engine); a router policy that ignores the routing key (round_robin) can send a
    session's turns to several engines, so each sees its session_id; kvgate's placement moves a session only
    when it re-opens (after a close) while its engine is at the pressure threshold, or its engine left."""
    total = sum(f.closes.values())
    again = sum(c - 1 for c in f.session_closes if c > 1)
    calls = total * f.engines
    calls_ok = calls - f.failed_calls
    by_reason = ", ".join(f"{k} {v}" for k, v in f.closes.items())
    sent = None if f.calls_ok is None else f.calls_ok + (f.calls_error or 0)
    resent = "" if sent is None or sent == calls else (
        f" (kvgate sent {sent}: {f.calls_ok} ok, {f.calls_error or 0} errors; a close sent again (a retry, or a close "
        f"asked for again) reaches an engine twice)")
    lines = [
        f"sessions   {f.sessions} in the trace window, {f.closed} closed at the end; {total} closes ({by_reason}) = "
        f"{total - again} sessions + {again} closed again (they sent a turn after their idle close)",
        f"fan-out    {calls} /close_session calls = {total} closes x {f.engines} engines: {calls_ok} ok, "
        f"{f.failed_calls} failed{resent}" + ("" if f.engine_closes is None else
                                               f"; the engines received {' + '.join(map(str, f.engine_closes))} = "
                                               f"{sum(f.engine_closes)}"),
    ]
    off = []
    if f.closed != f.sessions:
        off.append(f"{_n(f.sessions - f.closed, 'session')} not closed at the end")
    if total - again != len([c for c in f.session_closes if c > 0]):
        off.append(f"{total} closes by reason, but the registry has {sum(f.session_closes)} closes of "
                   f"{len([c for c in f.session_closes if c > 0])} sessions")
    if f.engine_closes is not None:
        got = sum(f.engine_closes)
        if sent is None and got != calls_ok:
            off.append(f"the engines received {got} closes, kvgate made {calls_ok} successful calls")
        elif sent is not None and not f.calls_ok <= got <= sent:
            off.append(f"the engines received {got} closes, kvgate sent {sent} ({f.calls_ok} ok)")
    if f.engine_sessions is None:
        lines.append("engines    real engines do not report the session ids and closes they received")
        return lines, off
    seen = set().union(*f.engine_sessions) if f.engine_sessions else set()
    on_many = sum(1 for sid in seen if sum(sid in e for e in f.engine_sessions) > 1)
    per_engine = sum(len(e) for e in f.engine_sessions)
    lines.append(
        f"engines    session_id reached an engine for {len(seen)} sessions; per engine "
        f"{' + '.join(str(len(e)) for e in f.engine_sessions)} = {per_engine}"
        + ((f" ({_n(on_many, 'session')} had turns on more than one engine: the router's policy does not keep a "
            f"session on one engine)" if f.placed_by == "router" else
            f" ({_n(on_many, 'session')} had turns on more than one engine: re-opened after a close while their "
            f"engine was at the placement pressure threshold)") if on_many else ""))
    if len(seen) != f.sessions:
        off.append(f"session_id reached the engines for {len(seen)} sessions, the trace window has {f.sessions}")
    return lines, off


class ScaledBook(TokenBook):
    """A TokenBook for small real engines (pure): each record's token counts divided by ``scale`` (each hash
    block becomes its first BLOCK_TOKENS / scale ids, so prompts share the trace's prefixes as before), and
    every id folded into 3..vocab-1 (0-2 are the tiny model's special tokens; an id at or past its vocabulary
    crashes SGLang 0.5.23's scheduler)."""

    def __init__(self, scale: int = 1, vocab: int | None = None) -> None:
        super().__init__()
        self.scale = max(1, int(scale))
        self.vocab = vocab

    def scaled(self, rec) -> TraceRecord:
        if self.scale == 1:
            return rec
        return TraceRecord(rec.timestamp_ms, max(1, rec.input_length // self.scale),
                           max(1, rec.output_length // self.scale), rec.hash_ids)

    def prompt(self, rec) -> list[int]:
        if self.scale == 1 and self.vocab is None:
            return super().prompt(rec)
        block = max(1, BLOCK_TOKENS // self.scale)
        want = self.scaled(rec).input_length
        ids: list[int] = []
        for h in rec.hash_ids:
            ids.extend(super().prompt(TraceRecord(0, BLOCK_TOKENS, 1, (h,)))[:block])
            if len(ids) >= want:
                break
        ids = ids[:want]
        return ids if self.vocab is None else [3 + t % (self.vocab - 3) for t in ids]


def _request(route: str, book: TokenBook, rec, rid: str, model: str = "kvgate-sim") -> tuple[str, bytes]:
    """The path and body of one turn: the whole prompt every time (token ids, or text for /v1/completions)."""
    scaled = book.scaled(rec) if isinstance(book, ScaledBook) else rec
    max_new = max(1, scaled.output_length)
    if route == "generate":
        return "/generate", orjson.dumps({"input_ids": book.prompt(rec), "rid": rid,
                                          "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}})
    return "/v1/completions", orjson.dumps({"model": model, "prompt": book.prompt_text(rec),
                                            "max_tokens": max_new, "ignore_eos": True, "rid": rid})


def _usage(route: str, payload: bytes) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) from a response body."""
    obj = orjson.loads(payload)
    if route == "generate":
        meta = obj.get("meta_info", {})
        return int(meta.get("prompt_tokens", 0)), int(meta.get("cached_tokens", 0))
    usage = obj.get("usage", {})
    return int(usage.get("prompt_tokens", 0)), int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


async def _replay(base: str, records, sessions, speed: float, progress, route: str,
                  book: TokenBook | None = None, model: str = "kvgate-sim") -> Replay:
    book = book or TokenBook()
    out = Replay()
    t0 = time.monotonic()
    first_ts = records[0].timestamp_ms if records else 0
    done = 0

    async def one(http: aiohttp.ClientSession, rec, sid: str, turn: int) -> None:
        nonlocal done
        delay = (rec.timestamp_ms - first_ts) / 1000.0 / speed - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)  # open-loop replay at the trace's timestamps
        path, body = _request(route, book, rec, f"{sid}-turn{turn}", model)
        start = time.monotonic()
        try:
            async with http.post(base + path, data=body, headers={
                    "Content-Type": "application/json", "X-Session-ID": sid}) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    key = f"http {resp.status}"
                    out.errors[key] = out.errors.get(key, 0) + 1
                    return
                prompt, cached = _usage(route, payload)
                out.ok += 1
                out.latencies.append(time.monotonic() - start)
                out.prompt_tokens += prompt
                out.cached_tokens += cached
                decision = resp.headers.get("X-Kvgate-Admission")
                if decision:
                    out.admission[decision] = out.admission.get(decision, 0) + 1
                    out.queue_ms.append(float(resp.headers.get("X-Kvgate-Queue-Ms", "0")))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            key = type(exc).__name__
            out.errors[key] = out.errors.get(key, 0) + 1
        finally:
            done += 1
            progress(done)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as http:
        await asyncio.gather(*(one(http, rec, sid, turn) for rec, sid, turn in iter_turns(records, sessions)))
    return out


async def _all_sessions(http: aiohttp.ClientSession, base: str, **params: str) -> list[dict]:
    """Every session in kvgate's registry (``params``: e.g. state), page by page: the endpoint answers a page
    of at most 1,000. Read once the replay is over, when no turn reorders the registry between pages."""
    out: list[dict] = []
    while True:
        async with http.get(base + "/kvgate/sessions", params={**params, "offset": str(len(out))}) as r:
            page = await r.json()
        out += page["sessions"]
        if len(page["sessions"]) < page["limit"] or not page["sessions"]:
            return out


async def _close_remaining(base: str) -> dict[str, int]:
    """Close every session still open through kvgate's API and wait for each fan-out."""
    async with aiohttp.ClientSession() as http:
        active = [s["session_id"] for s in await _all_sessions(http, base, state="active")]
        results = await asyncio.gather(*(http.post(f"{base}/kvgate/sessions/{sid}/close", params={"wait": "1"})
                                         for sid in active))
        for r in results:
            r.release()
    return {"closed_at_end": len(active)}


async def _registry(base: str) -> list[dict]:
    async with aiohttp.ClientSession() as http:
        return await _all_sessions(http, base)


async def _get_json(url: str):
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as r:
            return await r.json()


async def _metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as r:
            return await r.text()


def _sum_metric(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _trace_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    return Path(str(resources.files("kvgate") / "data" / DEFAULT_TRACE))


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 when every request succeeded and every session was closed on every engine."""
    path = _trace_path(args.trace)
    records = read_trace(path, int(args.start_s * 1000), int(args.duration_s * 1000))
    if not records:
        print(f"kvgate demo: no trace records in that window of {path}", file=sys.stderr)
        return 2
    sessions = infer_sessions(records)
    if args.sessions == "multi-turn":
        turns: dict[str, int] = {}
        for sid in sessions:
            turns[sid] = turns.get(sid, 0) + 1
        keep = [i for i, sid in enumerate(sessions) if turns[sid] > 1]
        if not keep:
            print(f"kvgate demo: no session has two turns in that window of {path} (widen --duration-s, or "
                  "--sessions all)", file=sys.stderr)
            return 2
        records, sessions = [records[i] for i in keep], [sessions[i] for i in keep]
    gaps = turn_gaps(records, sessions)
    idle = idle_close_from_gaps(gaps)
    chosen = args.idle_close_s is not None
    if chosen:
        idle = IdleClose(args.idle_close_s, idle.gaps, idle.median_s, idle.p95_s,
                         sum(1 for g in gaps if g > args.idle_close_s))
    args.idle_close_s = idle.idle_s
    real = args.engine == "sglang"
    if args.engine_url and not real:
        print("kvgate demo: --engine-url needs --engine sglang", file=sys.stderr)
        return 2
    if args.engines is None:
        args.engines = len(args.engine_url) if args.engine_url else (2 if real else 4)
    if args.max_total_num_tokens is None:
        args.max_total_num_tokens = 8000 if real else 200_000
    if args.token_scale is None:
        args.token_scale = 32 if real else 1
    if real and not args.engine_url:
        from kvgate.tools import sglang_engine as real_engine
        why = real_engine.unavailable_reason()
        if why:
            print(f"kvgate demo: no real SGLang engine here ({why})", file=sys.stderr)
            return 2
    if not procs.smg_installed():
        print("kvgate demo: the smg router is not installed (pip install smg, or run `make demo`)", file=sys.stderr)
        return 2
    print(f"kvgate demo: {idle_line(idle, args.speed, chosen)}", flush=True)
    base_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvgate-demo-"))
    modes = {"compare": ["smg", "lifecycle"], "all": ["smg", "lifecycle", "admission"], "smg": ["smg"],
             "lifecycle": ["lifecycle"], "admission": ["admission"], "both": ["lifecycle", "admission"]}[args.runs]
    titles = {"smg": f"smg alone ({args.router_policy}), no kvgate",
              "lifecycle": "kvgate in front of smg: session lifecycle on, program-aware admission off",
              "admission": "kvgate in front of smg: session lifecycle on, program-aware admission on"}
    summaries = []
    for mode in modes:
        print(f"\n=== run: {titles[mode]} ===", flush=True)
        if mode == "smg":
            summaries.append(_run_router_alone(args, records, sessions, base_dir / "smg"))
        else:
            summaries.append(_run_once(args, records, sessions, mode == "admission", base_dir / mode))
    alone = next((s for s in summaries if s["run"] == "smg"), None)
    if alone is not None:
        for s in summaries:
            if s["run"] != "smg":
                s["against_smg"] = gain_line(alone, s)
                print(f"\n{s['against_smg']}", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summaries, indent=2))
    return 1 if any(s["failed"] for s in summaries) else 0


#: Two figures of the demo's last line closer than this (relative) count as the same.
SAME_WITHIN = 0.05


def gain_line(alone: dict, kv: dict) -> str:
    """The demo's last line: what kvgate (summary ``kv``) gained or lost against smg alone (``alone``) on the same
    replay, with the figures behind it: the prompt tokens the engines computed (prompt - cached), the cache hit
    rate and the turns' latency p50 and p99 (each better or worse only beyond SAME_WITHIN). Pure."""
    def computed(s: dict) -> int:
        return s["prompt_tokens"] - s["cached_tokens"]

    def hit(s: dict) -> float:  # from the counts, as each run's summary prints it (not the rounded rate)
        return s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0

    c_a, c_k = computed(alone), computed(kv)
    name = "kvgate (session lifecycle" + (" + admission)" if kv["run"] == "admission" else ")")
    pairs = [(c_k, c_a), (kv["latency_p50_s"], alone["latency_p50_s"]), (kv["latency_p99_s"], alone["latency_p99_s"])]
    # within SAME_WITHIN of each other two figures count as the same: one run's noise on a shared machine
    better = [k < a * (1 - SAME_WITHIN) for k, a in pairs]
    worse = [k > a * (1 + SAME_WITHIN) for k, a in pairs]
    verdict = ("gained" if any(better) and not any(worse) else "lost" if any(worse) and not any(better)
               else "gained and lost" if any(better) else f"changed nothing beyond {SAME_WITHIN:.0%}")
    moved = [n for n, b, w in zip(("prompt compute", "p50", "p99"), better, worse) if b or w]
    if moved:  # say which figures moved: a gain in the tail alone reads differently from one in every figure
        verdict += f" ({', '.join(moved)} beyond {SAME_WITHIN:.0%}; one run each)"

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "-"
    fails = "" if kv["ok"] == kv["requests"] and alone["ok"] == alone["requests"] else (
        f"; answered {kv['ok']}/{kv['requests']} against {alone['ok']}/{alone['requests']}")
    return (f"result: {name} {verdict} against smg alone on the same {kv['requests']} turns: the engines computed "
            f"{c_k:,} prompt tokens against {c_a:,} ({ratio(c_k, c_a)}; cache hit {hit(kv):.1%} against "
            f"{hit(alone):.1%}), turn latency p50 {kv['latency_p50_s']:.3f} s against "
            f"{alone['latency_p50_s']:.3f} s ({ratio(kv['latency_p50_s'], alone['latency_p50_s'])}), p99 "
            f"{kv['latency_p99_s']:.3f} s against {alone['latency_p99_s']:.3f} s "
            f"({ratio(kv['latency_p99_s'], alone['latency_p99_s'])}){fails}")


def _real_vocab() -> int:
    from kvgate.tools.sglang_cpu.make_model import VOCAB
    return VOCAB


def _start_real(args: argparse.Namespace, log_dir: Path, out: list) -> list[str]:
    """Start ``args.engines`` real engines at once (kvgate.tools.sglang_engine); appends each to ``out`` (the caller
    stops them) and returns their URLs."""
    import concurrent.futures

    from kvgate.tools import sglang_engine as real_engine
    spec = real_engine.EngineSpec(max_total_tokens=args.max_total_num_tokens)
    print(f"kvgate demo: starting {args.engines} real SGLang engines (20-30 s each on an idle machine)", flush=True)
    with concurrent.futures.ThreadPoolExecutor(args.engines) as pool:
        futs = [pool.submit(real_engine.start_engine, spec, log_dir, f"engine{i}") for i in range(args.engines)]
        errors = []
        for f in futs:
            try:
                out.append(f.result())
            except Exception as exc:  # noqa: BLE001 - the others are stopped by the caller, then this is raised
                errors.append(exc)
    if errors:
        raise errors[0]
    return [e.url for e in out]


def _start_fleet(args: argparse.Namespace, log_dir: Path, started: list,
                 real_engines: list) -> tuple[list[str], procs.Proc]:
    """The engines (simulated, started here; or real: started, or ``--engine-url``, radix caches flushed) and smg
    in front of them with ``--router-policy``. Appends what it starts to ``started`` / ``real_engines`` (the
    caller stops them). Returns (engine URLs, the router)."""
    if args.engine == "sglang":
        engine_urls = list(args.engine_url) or _start_real(args, log_dir, real_engines)
        for u in engine_urls:  # each run starts from empty radix caches
            from kvgate.tools.sglang_engine import flush_cache
            flush_cache(u, 120)
    else:
        engine_urls = []
        for i in range(args.engines):
            port = procs.free_port()
            url = f"http://127.0.0.1:{port}"
            p = procs.start(f"engine{i}", [sys.executable, "-m", "kvgate", "sim-engine", "--port", str(port),
                                           "--max-total-num-tokens", str(args.max_total_num_tokens),
                                           "--speed", str(args.speed)], log_dir, url=url)
            started.append(p)
            engine_urls.append(url)
        for p in started:
            procs.wait_http(p.url + "/health", 30, p)
    rport, mport = procs.free_port(), procs.free_port()
    router = procs.start("smg", procs.smg_command(rport, engine_urls, mport, policy=args.router_policy), log_dir,
                         url=f"http://127.0.0.1:{rport}")
    started.append(router)
    procs.wait_http(router.url + "/readiness", 60, router, procs.router_ready(len(engine_urls)))
    return engine_urls, router


def _progress(n: int):
    last = [time.monotonic()]

    def progress(done: int) -> None:
        if time.monotonic() - last[0] >= 10 or done == n:
            last[0] = time.monotonic()
            print(f"  ... {done}/{n} requests done", flush=True)
    return progress


def _path_line(args: argparse.Namespace, records, n_sessions: int, hops: str, n_engines: int, log_dir: Path) -> None:
    kind = "real SGLang engines" if args.engine == "sglang" else "simulated engines"
    pool = "" if args.engine == "sglang" and args.engine_url else \
        f" (max_total_num_tokens {args.max_total_num_tokens} each)"
    scale = f"; token counts / {args.token_scale}" if args.token_scale > 1 else ""
    only = ", multi-turn only" if args.sessions == "multi-turn" else ""
    print(f"kvgate demo: {args.duration_s:.0f} s of the Mooncake conversation trace from {args.start_s:.0f} s "
          f"({len(records)} requests, {n_sessions} sessions{only}) at speed {args.speed:g}", flush=True)
    print(f"  path: client -> {hops} -> {n_engines} {kind}{pool}{scale}; logs in {log_dir}", flush=True)


def _latency_cache(rep: Replay, n: int, wall: float) -> tuple[dict, list[str]]:
    """The figures every run reports (requests, latency, cache) and their summary lines."""
    hit = rep.cached_tokens / rep.prompt_tokens if rep.prompt_tokens else 0.0
    figures = {"requests": n, "ok": rep.ok, "errors": rep.errors, "wall_s": round(wall, 1),
               "prompt_tokens": rep.prompt_tokens, "cached_tokens": rep.cached_tokens,
               "cache_hit_rate": round(hit, 4), "latency_p50_s": round(percentile(rep.latencies, 50), 3),
               "latency_p99_s": round(percentile(rep.latencies, 99), 3)}
    lines = [f"requests   {rep.ok}/{n} ok, errors {rep.errors or 0}, replay wall time {wall:.1f} s",
             f"latency    p50 {figures['latency_p50_s']:.3f} s, p99 {figures['latency_p99_s']:.3f} s",
             f"cache      hit rate {hit:.1%} ({rep.cached_tokens} of {rep.prompt_tokens} prompt tokens cached; the "
             f"engines computed {rep.prompt_tokens - rep.cached_tokens})"]
    return figures, lines


def _run_router_alone(args: argparse.Namespace, records, sessions, log_dir: Path) -> dict:
    """The replay straight to smg (no kvgate) on a fresh fleet; prints and returns its summary."""
    started: list[procs.Proc] = []
    real_engines: list = []
    real = args.engine == "sglang"
    book = ScaledBook(args.token_scale, _real_vocab() if real else None)
    try:
        engine_urls, router = _start_fleet(args, log_dir, started, real_engines)
        _path_line(args, records, len(set(sessions)), f"smg {router.url} ({args.router_policy})", len(engine_urls),
                   log_dir)
        t0 = time.monotonic()
        rep = asyncio.run(_replay(router.url, records, sessions, args.speed, _progress(len(records)), args.route,
                                  book, "kvgate-tiny" if real else "kvgate-sim"))
        wall = time.monotonic() - t0
    except BaseException:
        print(f"kvgate demo: stopping the {len(started) + len(real_engines)} processes it started", file=sys.stderr,
              flush=True)
        raise
    finally:
        procs.stop_all(started)
        for e in real_engines:
            e.stop()
    figures, lines = _latency_cache(rep, len(records), wall)
    print("summary")
    for line in lines:
        print(f"  {line}")
    return {"run": "smg", "router_policy": args.router_policy, "engine": args.engine, "engines": len(engine_urls),
            "route": args.route, **figures, "failed": rep.ok != len(records)}


def _run_once(args: argparse.Namespace, records, sessions, admission: bool, log_dir: Path) -> dict:
    """One run through kvgate on a fresh fleet (engines, smg, kvgate); prints and returns its summary."""
    n_sessions = len(set(sessions))
    started: list[procs.Proc] = []
    real_engines: list = []  # kvgate.tools.sglang_engine.Engine, started here (stopped at the end)
    speed = args.speed
    real = args.engine == "sglang"
    book = ScaledBook(args.token_scale, _real_vocab() if real else None)
    model = "kvgate-tiny" if real else "kvgate-sim"
    try:
        engine_urls, router = _start_fleet(args, log_dir, started, real_engines)
        kport = procs.free_port()
        kv_cmd = [sys.executable, "-m", "kvgate", "serve", "--upstream", router.url, "--port", str(kport),
                  "--agentic-session-lifecycle", "--session-idle-close-s", str(args.idle_close_s / speed),
                  "--discovery-interval-s", str(max(0.5, 5 / speed)), "--router-policy", args.router_policy]
        if args.route == "generate":  # kvgate keeps each session on one engine (round_robin would not)
            kv_cmd += ["--session-placement", "kvgate"]
        if admission:
            kv_cmd += ["--agentic-program-admission", "--admission-poll-interval-s", str(max(0.05, 2.0 / speed)),
                       "--agentic-admission-max-wait-s", str(30.0 / speed)]
            if args.route == "completions" and not real:
                # The simulator counts one token per byte of text (kvgate.sim.tokenizer); at the default 3
                # characters per token the ledger would count each text prompt at a third of its size.
                kv_cmd += ["--admission-chars-per-token", "1"]
        kvgate = procs.start("kvgate", kv_cmd, log_dir, url=f"http://127.0.0.1:{kport}")
        started.append(kvgate)
        procs.wait_http(kvgate.url + "/kvgate/engines", 30, kvgate,
                        lambda st, body: st == 200 and len(json.loads(body)["engines"]) == len(engine_urls))
        if admission:  # start once the ledger has its first capacity snapshot
            procs.wait_http(kvgate.url + "/kvgate/stats", 30, kvgate,
                            lambda st, body: st == 200 and not json.loads(body)["ledger"]["degraded"])

        _path_line(args, records, n_sessions, f"kvgate {kvgate.url} -> smg {router.url} ({args.router_policy})",
                   len(engine_urls), log_dir)
        t0 = time.monotonic()
        rep = asyncio.run(_replay(kvgate.url, records, sessions, speed, _progress(len(records)), args.route, book,
                                  model))
        wall = time.monotonic() - t0
        end = asyncio.run(_close_remaining(kvgate.url))
        reg = asyncio.run(_registry(kvgate.url))
        mtext = asyncio.run(_metrics_text(kvgate.url + "/metrics"))
        sims = None if real else [asyncio.run(_get_json(u + "/sim/stats")) for u in engine_urls]
        stats = asyncio.run(_get_json(kvgate.url + "/kvgate/stats")) if admission else None
        health = asyncio.run(_get_json(kvgate.url + "/kvgate/health"))
        placement = asyncio.run(_get_json(kvgate.url + "/kvgate/engines")).get("placement") or {}
    except BaseException:  # Ctrl-C, SIGTERM or a failure: say why the wait, then stop (finally)
        print(f"kvgate demo: stopping the {len(started)} processes it started", file=sys.stderr, flush=True)
        raise
    finally:
        procs.stop_all(started)
        for e in real_engines:
            e.stop()

    closes = {k: int(_sum_metric(mtext, "agentic_kv_session_close_total", reason=k))
              for k in ("idle", "client", "admin_api", "abort")}
    close_fail = int(_sum_metric(mtext, "agentic_kv_session_close_failure_total"))
    closed = sum(1 for s in reg if s["state"] == "closed")
    path = "/generate" if args.route == "generate" else "/v1/completions"
    placed_by = health["session_placement"][path]
    figures = CloseFigures(sessions=n_sessions, closed=closed, closes=closes,
                           session_closes=[s["closes"] for s in reg], engines=len(engine_urls),
                           failed_calls=close_fail,
                           engine_closes=None if sims is None else [s["closes_received"] for s in sims],
                           engine_sessions=None if sims is None else [set(s["sessions"]) for s in sims],
                           placed_by=placed_by,
                           calls_ok=int(_sum_metric(mtext, "agentic_kv_session_close_calls_total", result="ok")),
                           calls_error=int(_sum_metric(mtext, "agentic_kv_session_close_calls_total",
                                                       result="error")))
    lines, off = reconcile(figures)
    common, first_lines = _latency_cache(rep, len(records), wall)
    summary = {
        "run": "admission" if admission else "lifecycle", **common,
        "sessions": n_sessions, "sessions_closed": closed, "closes_by_reason": closes,
        "idle_close_s": args.idle_close_s,
        "close_calls": sum(closes.values()) * len(engine_urls), "close_failures": close_fail, **end,
        "engine": args.engine, "engines": len(engine_urls), "token_scale": args.token_scale,
        "engine_sessions_seen": None if sims is None else [len(x) for x in figures.engine_sessions],
        "engine_sessions_union": None if sims is None else len(set().union(*figures.engine_sessions)),
        "engine_closes_received": figures.engine_closes, "not_adding_up": off,
        "admission": rep.admission,
        "queue_ms_p50": round(percentile(rep.queue_ms, 50), 1) if rep.queue_ms else None,
        "queue_ms_p99": round(percentile(rep.queue_ms, 99), 1) if rep.queue_ms else None,
        "admission_stats": stats, "route": args.route,
        "router_generate_session_id": health["session_id_passthrough"],
        "session_placement": health.get("session_placement"), "placed_by": placed_by,
        "placement_counts": placement.get("counts"),
    }
    print("summary")
    for line in first_lines + lines:
        print(f"  {line}")
    for line in off:
        print(f"  DOES NOT ADD UP: {line}")
    verdict = health["session_id_passthrough_by_route"].get(path, health["session_id_passthrough"])
    print(f"  {router_line(path, verdict, placed_by)}")
    if placed_by == "kvgate" and placement.get("counts"):
        print(f"  {placement_line(placement['counts'])}")
    if admission:
        c = stats["counters"]
        print(f"  admission  admit {c['admit']}, wait {c['wait']}, bypass {c['bypass']} "
              f"(protected {c['bypass_protected']}, degraded {c['bypass_degraded']}, aged {c['bypass_aged']}, "
              f"cost {c.get('bypass_cost', 0)}), "
              f"cancelled {c['cancelled']}; queue wait p50 {summary['queue_ms_p50']} ms, p99 {summary['queue_ms_p99']} ms, "
              f"max {max(rep.queue_ms) if rep.queue_ms else 0:.0f} ms; ceiling {stats['ledger']['ceiling']} tokens")
    summary["failed"] = rep.ok != len(records) or close_fail > 0 or bool(off)
    return summary
