"""Measure a real CPU SGLang engine's compute and fit the simulator's compute constants to it.

    KVGATE_ENGINE_VENV=... python scripts/fit_engine_profile.py [--profile mlp] [--out FILE.json]

Starts one engine (kvgate.tools.sglang_engine, the ``mlp`` model by default, a pool large enough that nothing is
evicted), then, one request at a time:
- prefill: uncached prompts of 128-1,024 ids and cached prefixes of 256 and 1,024 ids extended by 32-512 ids, each
  with max_new_tokens 1 (the latency is the prefill's);
- decode: B concurrent streamed requests (B = 1..16, contexts 200 and 800 ids) of 24 new tokens each; the step
  time is the median over requests of (last chunk - first chunk) / (tokens - 1).
and prints the least-squares fits (kvgate.sim.fit) as ``kvgate sim-engine`` flags, with every sample in --out.
``--engines N`` starts N engines and measures them all at once (each its own random prompts), pooling the samples:
the fit then describes an engine that shares the host's cores with N - 1 busy others, as the bench's engines do.
``--contention`` instead measures what two engines on this host cost each other (the simulator's
``--host-contention-prefill`` / ``--host-contention-decode``): the same prefill (512 uncached ids) and decode step
(4 streams of 32 tokens over 200-id prompts) timed on one engine alone and on both engines at once, each
``--reps`` times (5 by default here), alternating; the slowdown is (together / alone) - 1 of the medians.
The machine's load average at start and end is recorded: the timings are only as steady as the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.sim.fit import fit_decode, fit_prefill  # noqa: E402
from kvgate.tools.sglang_engine import EngineSpec, flush_cache, start_engine  # noqa: E402


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


async def _one(http: aiohttp.ClientSession, url: str, ids: list[int], new: int, stream: bool = False) -> dict:
    body = {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": new, "min_new_tokens": new, "temperature": 0}}
    t0 = time.monotonic()
    first = last = None
    n = 0
    meta = {}
    async with http.post(url + "/generate", json=body) as resp:
        if not stream:
            obj = await resp.json()
            meta = obj["meta_info"]
        else:
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                obj = json.loads(line[6:])
                k = len(obj.get("output_ids") or [])
                now = time.monotonic()
                if k and first is None:
                    first = now
                if k > n:
                    last, n = now, k
                meta = obj.get("meta_info") or meta
    t1 = time.monotonic()
    return {"wall_s": t1 - t0, "first_s": (first - t0) if first else None, "last_s": (last - t0) if last else None,
            "n": n, "cached": meta.get("cached_tokens"), "prompt": meta.get("prompt_tokens")}


async def _decode_steps(http: aiohttp.ClientSession, url: str, rng: random.Random, batch: int, ctx: int,
                        new: int) -> list[float]:
    """``batch`` concurrent streamed requests of ``new`` tokens over ``ctx``-id prompts: each request's decode
    step time, (last chunk - first chunk) / (tokens - 1), seconds."""
    rs = await asyncio.gather(*(_one(http, url, _ids(rng, ctx), new, stream=True) for _ in range(batch)))
    return [(r["last_s"] - r["first_s"]) / (r["n"] - 1) for r in rs if r["first_s"] and r["n"] > 1]


async def measure(url: str, rng: random.Random, reps: int) -> dict:
    out = {"prefill": [], "decode": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await _one(http, url, _ids(rng, 64), 1)  # warm
        for _ in range(reps):
            for n in (128, 256, 512, 1024):
                r = await _one(http, url, _ids(rng, n), 1)
                out["prefill"].append({"prefix": 0, "extend": n, "s": r["wall_s"], "cached": r["cached"]})
            for p in (256, 1024):
                for e in (32, 128, 512):
                    base = _ids(rng, p)
                    await _one(http, url, base, 1)
                    r = await _one(http, url, base + _ids(rng, e), 1)
                    out["prefill"].append({"prefix": r["cached"] or 0, "extend": r["prompt"] - (r["cached"] or 0),
                                           "s": r["wall_s"], "cached": r["cached"]})
            flush_cache(url)
        for ctx in (200, 800):
            for b in (1, 2, 4, 8, 16):
                if ctx * b > 20000:
                    continue
                steps = await _decode_steps(http, url, rng, b, ctx, 24)
                out["decode"].append({"batch": b, "ctx": ctx, "step_s": statistics.median(steps),
                                      "steps": sorted(steps)})
                flush_cache(url)
    return out


async def _decode_step(http: aiohttp.ClientSession, url: str, rng: random.Random, batch: int = 4,
                       ctx: int = 200, new: int = 32) -> float:
    return statistics.median(await _decode_steps(http, url, rng, batch, ctx, new))


async def measure_contention(urls: list[str], reps: int) -> dict:
    """Prefill and decode timed on ``urls[0]`` alone and on every engine at once, ``reps`` rounds of each,
    alternating so that a drift of the machine's load hits both alike. Returns the samples (seconds) and the
    slowdowns ((together / alone) - 1 of the medians)."""
    rngs = [random.Random(100 + i) for i in range(len(urls))]
    out = {"prefill_alone": [], "prefill_together": [], "decode_alone": [], "decode_together": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await asyncio.gather(*(_one(http, u, _ids(rngs[i], 64), 4) for i, u in enumerate(urls)))  # warm
        for _ in range(reps):
            r = await _one(http, urls[0], _ids(rngs[0], 512), 1)
            out["prefill_alone"].append(r["wall_s"])
            rs = await asyncio.gather(*(_one(http, u, _ids(rngs[i], 512), 1) for i, u in enumerate(urls)))
            out["prefill_together"] += [x["wall_s"] for x in rs]
            out["decode_alone"].append(await _decode_step(http, urls[0], rngs[0]))
            out["decode_together"] += await asyncio.gather(*(_decode_step(http, u, rngs[i])
                                                             for i, u in enumerate(urls)))
            for u in urls:
                flush_cache(u)
    med = {k: statistics.median(v) for k, v in out.items()}
    out["medians_s"] = med
    out["slowdown"] = {"prefill": med["prefill_together"] / med["prefill_alone"] - 1,
                       "decode": med["decode_together"] / med["decode_alone"] - 1}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="mlp")
    ap.add_argument("--reps", type=int, default=None, help="rounds of probes (default 1; 5 with --contention)")
    ap.add_argument("--contention", action="store_true",
                    help="measure what two engines cost each other instead of fitting the profile (starts 2)")
    ap.add_argument("--engine-extra", default="[]", help="more SGLang flags, a JSON list (as a scenario's engine_extra)")
    ap.add_argument("--engines", type=int, default=1,
                    help="engines measured at once on this host (samples pooled); default 1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.engines < 1:
        ap.error("--engines must be >= 1")
    if args.contention:
        args.engines = max(args.engines, 2)
    reps = args.reps if args.reps is not None else (5 if args.contention else 1)
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-fit-"))
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    engines = []
    try:
        for _ in range(args.engines):
            engines.append(start_engine(EngineSpec(max_total_tokens=40000, profile=args.profile, session_cache=False,
                                                   served_model_name=f"kvgate-{args.profile}",
                                                   extra=[str(x) for x in json.loads(args.engine_extra)]),
                                        log_dir, timeout_s=900))

        if args.contention:
            result = asyncio.run(measure_contention([e.url for e in engines], reps))
        else:
            async def _all():
                return await asyncio.gather(*(measure(e.url, random.Random(i), reps)
                                              for i, e in enumerate(engines)))
            parts = asyncio.run(_all())
    finally:
        for e in engines:
            e.stop()
    if args.contention:
        result["engines"] = args.engines
        result["loadavg_start"], result["loadavg_end"] = load0, Path("/proc/loadavg").read_text().split()[:3]
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        for k, v in result["medians_s"].items():
            print(f"{k:18s} median {v * 1000:8.1f} ms  of {len(result[k])}")
        sd = result["slowdown"]
        print(f"--host-contention-prefill {sd['prefill']:.2f} --host-contention-decode {sd['decode']:.2f}")
        print(f"load average {' '.join(result['loadavg_start'])} -> {' '.join(result['loadavg_end'])}")
        return 0
    data = {"engines": args.engines, "prefill": [d for p in parts for d in p["prefill"]],
            "decode": [d for p in parts for d in p["decode"]]}
    data["loadavg_start"], data["loadavg_end"] = load0, Path("/proc/loadavg").read_text().split()[:3]
    pf = fit_prefill([(d["prefix"], d["extend"], d["s"]) for d in data["prefill"]])
    df = fit_decode([(d["batch"], d["batch"] * d["ctx"], d["step_s"]) for d in data["decode"]])
    data["fit"] = {"prefill": pf, "decode": df}
    if args.out:
        Path(args.out).write_text(json.dumps(data, indent=1))
    for d in data["prefill"]:
        print(f"prefill prefix {d['prefix']:5d} extend {d['extend']:5d}: {d['s'] * 1000:8.1f} ms")
    for d in data["decode"]:
        print(f"decode batch {d['batch']:3d} ctx {d['ctx']:5d}: step {d['step_s'] * 1000:7.2f} ms")
    print("fit:", json.dumps(data["fit"], indent=1))
    print(f"load average {' '.join(data['loadavg_start'])} -> {' '.join(data['loadavg_end'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
