"""What one Redis write costs kvgate's process, by the way it is sent (redis-py asyncio, as kvgate uses it).

Starts a throwaway redis-server, then writes the same session-turn update (kvgate's turn script: a hash, a
HINCRBY, two EXPIREs) TOTAL times, sent as:
  - single:      one EVALSHA per write, CONCURRENCY at once (as the per-request background calls did);
  - pipe-K:      pipelines of K EVALSHAs, one pipeline in flight;
  - batch-K:     one EVALSHA of a script that applies K writes (their keys and arguments flattened), one in
                 flight;
  - batch-K JSON: the same, the writes' arguments packed as one JSON argument (keys declared once each).
Prints the client's CPU per write (process time / writes, microseconds) and redis-server's (from /proc).

    .venv/bin/python scripts/redis_call_cost.py [--total 6000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

import orjson
from pathlib import Path

from kvgate.tools import procs

_TURN = """
local k = KEYS[1]
local f = 'if:' .. ARGV[3]
local n = redis.call('HINCRBY', k, f, tonumber(ARGV[4]))
if n == 0 then redis.call('HDEL', k, f) end
local last = tonumber(redis.call('HGET', k, 'last') or '0')
if tonumber(ARGV[1]) > last then redis.call('HSET', k, 'last', ARGV[1]) end
redis.call('EXPIRE', k, ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return n
"""

# The same write K times in one call: the op's body as a function of (KEYS, ARGV).
_BATCH = "local function turn(KEYS, ARGV)\n" + _TURN + "\nend\n" + """
local out = {}
for i = 1, #KEYS / 2 do
  out[i] = turn({KEYS[2 * i - 1], KEYS[2 * i]}, {ARGV[4 * i - 3], ARGV[4 * i - 2], ARGV[4 * i - 1], ARGV[4 * i]})
end
return out
"""

# The same, the writes' arguments as one JSON array in ARGV[1] (keys still declared in KEYS, each once):
# the client packs one argument instead of four per write.
_BATCH_JSON = "local function turn(KEYS, ARGV)\n" + _TURN + "\nend\n" + """
local out = {}
for i, op in ipairs(cjson.decode(ARGV[1])) do
  out[i] = turn({KEYS[op[1]], KEYS[op[2]]}, {op[3], op[4], op[5], op[6]})
end
return out
"""


def _server_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(url: str, pid: int, total: int, concurrency: int) -> list[tuple[str, float, float]]:
    import redis.asyncio as redis
    c = redis.Redis.from_url(url, decode_responses=True, max_connections=4096)
    turn, batch = c.register_script(_TURN), c.register_script(_BATCH)
    batch_json = c.register_script(_BATCH_JSON)
    keys = lambda i: [f"s:{i % 50}", f"p:{i % 50}"]
    args = lambda i: [repr(time.time()), 600, "r", 1 if i % 2 == 0 else -1]
    await turn(keys=keys(0), args=args(0))
    await batch(keys=keys(0), args=args(0))
    await batch_json(keys=keys(0), args=[orjson.dumps([[1, 2, *args(0)]])])
    out = []

    async def single():
        sem = asyncio.Semaphore(concurrency)

        async def one(i):
            async with sem:
                await asyncio.wait_for(turn(keys=keys(i), args=args(i)), 5)
        await asyncio.gather(*(one(i) for i in range(total)))

    async def pipe(k):
        for j in range(0, total, k):
            async with c.pipeline(transaction=False) as p:
                for i in range(j, j + k):
                    p.evalsha(turn.sha, 2, *keys(i), *args(i))
                await asyncio.wait_for(p.execute(), 5)

    async def batched(k):
        for j in range(0, total, k):
            ks, a = [], []
            for i in range(j, j + k):
                ks += keys(i)
                a += args(i)
            await asyncio.wait_for(batch(keys=ks, args=a), 5)

    async def batched_json(k):
        for j in range(0, total, k):
            index, ops = {}, []
            for i in range(j, j + k):
                sk, pk = keys(i)
                ops.append([index.setdefault(sk, len(index) + 1), index.setdefault(pk, len(index) + 1), *args(i)])
            await asyncio.wait_for(batch_json(keys=list(index), args=[orjson.dumps(ops)]), 5)

    runs = [(f"single ({concurrency} in flight)", single)]
    for k in (16, 64):
        runs += [(f"pipeline of {k}", lambda k=k: pipe(k)), (f"one script, {k} writes", lambda k=k: batched(k)),
                 (f"one script, {k} writes, JSON", lambda k=k: batched_json(k))]
    for name, run in runs:
        s0, c0 = _server_cpu_s(pid), time.process_time()
        await run()
        out.append((name, (time.process_time() - c0) / total * 1e6, (_server_cpu_s(pid) - s0) / total * 1e6))
    await c.aclose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total", type=int, default=6000)
    ap.add_argument("--concurrency", type=int, default=64)
    a = ap.parse_args()
    port = procs.free_port()
    p = procs.start("redis", procs.redis_command(port), Path(tempfile.mkdtemp(prefix="redis-cost-")))
    try:
        procs.wait_redis(port, 20, p)
        rows = asyncio.run(_measure(f"redis://127.0.0.1:{port}/0", p.popen.pid, a.total, a.concurrency))
    finally:
        p.stop(5.0)
    print(f"{'sent as':<28} {'client CPU/write':>17} {'redis-server CPU/write':>23}")
    for name, client, server in rows:
        print(f"{name:<28} {client:>14.1f} us {server:>20.1f} us")


if __name__ == "__main__":
    main()
