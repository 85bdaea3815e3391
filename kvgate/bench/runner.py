"""Run one arm on a fresh fleet (edge): simulated engines, a real smg router, kvgate where the arm needs it,
the workload client and a KV sampler. Every child is a subprocess in its own process group on 127.0.0.1
(kvgate.tools.procs) and is stopped by group when the arm ends.

Turns go out the way RL rollouts send them (scenario key ``api``): ``generate`` (default) sends token ids to
/generate (slime, AReaL, miles ...), ``chat`` a growing message list to /v1/chat/completions (verifiers, SkyRL
agents ...), ``completions`` text to /v1/completions; always ``stream: true`` (TTFT = first non-empty text chunk).
The ids are the simulator's byte tokenization of the workload's text (kvgate.sim.tokenizer), so
"previous ids + output ids + observation ids" is exactly what an input_ids client sends. The same requests go to
every arm; with session lifecycle on, kvgate places the sessions of /generate and chat itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import aiohttp
import orjson
import yaml

from kvgate.tools import procs
from kvgate.bench import sglang_fleet
from kvgate.bench.scenario import Scenario, sim_extra_flags
from kvgate.bench.speed import Scaled, kvgate_flags, split_load_monitor_interval
from kvgate.bench.workload import SessionPlan, TraceRequest, next_prompt
from kvgate.sim.tokenizer import encode


@dataclass(frozen=True)
class ArmSpec:
    """What one arm runs: kvgate on/off and its features, the router limiter, the KV pool per engine."""

    name: str
    kvgate: bool = False
    lifecycle: bool = False
    admission: bool = False
    admission_policy: str = "fifo"  # kvgate's admission_policy when admission is on: fifo | program
    router_limit: int | None = None
    pool_tokens: int = 0
    # False: the client names no session and never closes one (an unchanged rollout loop);
    # kvgate must infer sessions from prompt prefixes and end them itself.
    named_sessions: bool = True
    # engines run SGLang's hierarchical cache (a host-memory KV tier, --enable-hierarchical-cache)
    hicache: bool = False
    # kvgate places session traffic itself (session_placement: kvgate), with both features off
    placement: bool = False
    # this arm's smg --policy (None: the scenario's router_policy)
    router_policy: str | None = None
    # the scenario arm this one was expanded from when it differs from the name (router-sweep, router-limit)
    group: str | None = None
    # kvgate replicas (> 1: they share state through a redis-server of the arm's own, state_backend: redis,
    # and the client's sessions are split between them, see replica_for)
    replicas: int = 1
    # the program policy counts the engines' HiCache host pools (admission_host_cache); False: the device only
    host_cache: bool = True
    # more kvgate flags for this arm alone (after the scenario's: they win)
    kvgate_flags: tuple[str, ...] = ()
    # more smg flags for this arm alone
    router_flags: tuple[str, ...] = ()


#: The program policy as ThunderAgent runs it: the smallest program in a tool call pauses first, the smallest
#: paused one resumes first, a program ends only at its close or TTL, and a paused program waits for room.
THUNDER_FLAGS = ("--admission-pause-victim", "smallest", "--admission-resume-order", "smallest",
                 "--admission-program-overdue-multiple", "0", "--admission-resume-deadline-s", "0")


def expand_arms(sc: Scenario) -> list[ArmSpec]:
    """The scenario's arms in run order; router-limit becomes one arm per limit (router-limit-N)."""
    out = []
    for name in sc.arms:
        a, _, variant = name.partition("@")
        n = len(out)
        _expand_one(sc, a, out)
        if variant:  # ARM@NAME: the same arm with the named settings on top
            flags = tuple(_setting_flags(sc.arm_settings[variant], sc.speed))
            out[n:] = [replace(x, name=f"{x.name}@{variant}", kvgate_flags=x.kvgate_flags + flags) for x in out[n:]]
    return out


def _setting_flags(settings: dict, speed: float) -> list[str]:
    """``kvgate serve`` flags for one arm's settings: durations (the keys kvgate_times knows) divided by the
    speed factor, booleans as --key / --no-key."""
    from kvgate.bench.scenario import KVGATE_TIME_DEFAULTS
    out: list[str] = []
    for k, v in settings.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + k.replace("_", "-"))
            continue
        if k in KVGATE_TIME_DEFAULTS and v:
            v = float(v) / speed
        out += [flag, str(v)]
    return out


def _expand_one(sc: Scenario, a: str, out: list[ArmSpec]) -> None:
    """Append arm ``a``'s specs to ``out`` (router-limit becomes one per limit)."""
    pool = sc.max_total_num_tokens
    if a == "direct":
        out.append(ArmSpec(a, pool_tokens=pool))
    elif a in ("direct-no-overload", "direct-overload-off"):  # the router without its worker overload protection
        out.append(ArmSpec(a, pool_tokens=pool, router_flags=("--disable-worker-overload-protection",)))
    elif a == "proxy-only":
        out.append(ArmSpec(a, kvgate=True, pool_tokens=pool))
    elif a == "proxy-placement":
        out.append(ArmSpec(a, kvgate=True, placement=True, pool_tokens=pool))
    elif a == "smg-manual":
        out.append(ArmSpec(a, pool_tokens=pool, router_policy="manual"))
    elif a == "lifecycle":
        out.append(ArmSpec(a, kvgate=True, lifecycle=True, pool_tokens=pool))
    elif a == "lifecycle-inferred":
        out.append(ArmSpec(a, kvgate=True, lifecycle=True, pool_tokens=pool, named_sessions=False))
    elif a == "admission":
        out.append(ArmSpec(a, kvgate=True, admission=True, pool_tokens=pool))
    elif a == "lifecycle+admission":
        out.append(ArmSpec(a, kvgate=True, lifecycle=True, admission=True, pool_tokens=pool))
    elif a == "lifecycle+admission-2replicas":
        out.append(ArmSpec(a, kvgate=True, lifecycle=True, admission=True, pool_tokens=pool, replicas=2))
    elif a == "admission-program":
        out.append(ArmSpec(a, kvgate=True, admission=True, admission_policy="program", pool_tokens=pool))
    elif a == "lifecycle+admission-program":
        out.append(ArmSpec(a, kvgate=True, lifecycle=True, admission=True, admission_policy="program",
                           pool_tokens=pool))
    elif a == "lifecycle+admission-program-thunder":
        out.append(ArmSpec(a, kvgate=True, lifecycle=True, admission=True, admission_policy="program",
                           pool_tokens=pool, kvgate_flags=THUNDER_FLAGS))
    elif a == "router-limit":
        out += [ArmSpec(f"router-limit-{n}", router_limit=n, pool_tokens=pool, group=a) for n in sc.router_limits]
    elif a == "router-sweep":  # router only, one arm per router configuration
        out += [ArmSpec(f"router-{c['name']}", pool_tokens=pool, router_policy=c["policy"],
                        router_flags=tuple(str(x) for x in c.get("extra", [])), group=a)
                for c in sc.router_sweep]
    elif a == "unbounded-kv":
        out.append(ArmSpec(a, pool_tokens=sc.unbounded_max_total_num_tokens))
    elif a == "hicache":
        out.append(ArmSpec(a, pool_tokens=pool, hicache=True))
    elif a == "hicache+lifecycle":
        out.append(ArmSpec(a, kvgate=True, lifecycle=True, pool_tokens=pool, hicache=True))
    elif a == "hicache+lifecycle+admission":
        out.append(ArmSpec(a, kvgate=True, lifecycle=True, admission=True, pool_tokens=pool, hicache=True))
    elif a == "hicache+lifecycle+admission-program":
        out.append(ArmSpec(a, kvgate=True, lifecycle=True, admission=True, admission_policy="program",
                           pool_tokens=pool, hicache=True))
    elif a == "hicache+lifecycle+admission-program-thunder":
        out.append(ArmSpec(a, kvgate=True, lifecycle=True, admission=True, admission_policy="program",
                           pool_tokens=pool, hicache=True, kvgate_flags=THUNDER_FLAGS))
    elif a == "hicache+lifecycle+admission-program-device":  # the policy sees the device pools only
        out.append(ArmSpec(a, kvgate=True, lifecycle=True, admission=True, admission_policy="program",
                           pool_tokens=pool, hicache=True, host_cache=False))


class Fleet:
    """Engines + smg (+ kvgate) for one arm. ``base`` is where the client sends requests."""

    def __init__(self, sc: Scenario, arm: ArmSpec, scaled: Scaled, log_dir: Path, engine_pool=None):
        self.sc, self.arm, self.scaled, self.log_dir = sc, arm, scaled, log_dir
        # real engines (scenario engine: sglang): a kvgate.bench.sglang_fleet.EnginePool the bench owns, reused
        self.engine_pool = engine_pool
        self.procs: list[procs.Proc] = []
        self.engine_urls: list[str] = []
        # a PD fleet (scenario prefill_engines > 0): the prefill workers' (URL, bootstrap port); engine_urls lists
        # them first, then the decode workers
        self.prefill: list[tuple[str, int]] = []
        self.router_url = ""
        self.kvgate_url: str | None = None
        self.kvgate_urls: list[str] = []
        self.redis_url: str | None = None

    @property
    def base(self) -> str:
        return self.kvgate_url or self.router_url

    @property
    def bases(self) -> list[str]:
        """Where the client sends requests: every kvgate replica, or the one base."""
        return self.kvgate_urls or [self.base]

    def start(self) -> None:
        """Start everything and wait until it is ready. Raises RuntimeError/TimeoutError with a log tail."""
        if self.engine_pool is not None:  # real engines, flushed (or new for another pool size)
            self.engine_urls = self.engine_pool.urls(self.arm.pool_tokens)
        n_prefill = 0 if self.engine_pool is not None else self.sc.prefill_engines
        for i in range(0 if self.engine_pool is not None else n_prefill + self.sc.engines):
            port = procs.free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "kvgate", "sim-engine", "--port", str(port),
                   "--max-total-num-tokens", str(self.arm.pool_tokens), "--speed", repr(self.scaled.sim_speed)]
            cmd += sim_extra_flags(self.sc.sim_extra)
            if i < n_prefill:
                bport = procs.free_port()
                cmd += ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bport)]
                self.prefill.append((url, bport))
            elif n_prefill:
                cmd += ["--disaggregation-mode", "decode", "--disaggregation-decode-enable-radix-cache"]
            # the fleet's engines share this host: a contention figure in sim_extra takes effect through it
            cmd += ["--host-board", str(self.log_dir / "host-board")]
            if self.arm.hicache:
                cmd.append("--enable-hierarchical-cache")
            self.procs.append(procs.start(f"engine{i}", cmd, self.log_dir, url=url))
            self.engine_urls.append(url)
        for p in self.procs:
            procs.wait_http(p.url + "/health", 30, p)
        rport, mport = procs.free_port(), procs.free_port()
        router = procs.start("smg", self.router_command(rport, mport), self.log_dir,
                             url=f"http://127.0.0.1:{rport}")
        self.procs.append(router)
        self.router_url = router.url
        procs.wait_http(router.url + "/readiness", 60, router, procs.router_ready(len(self.engine_urls)))
        if not self.arm.kvgate:
            return
        shared: list[str] = []
        if self.arm.replicas > 1:
            # the replicas' shared state: a redis-server of this arm's own, gone with the fleet
            port = procs.free_port()
            redis = procs.start("redis", procs.redis_command(port), self.log_dir)
            self.procs.append(redis)
            procs.wait_redis(port, 20, redis)
            self.redis_url = f"redis://127.0.0.1:{port}/0"
            shared = ["--state-backend", "redis", "--redis-url", self.redis_url]
        for r in range(self.arm.replicas):
            self._start_kvgate(router.url, r, shared)

    def _start_kvgate(self, upstream: str, index: int, shared: list[str]) -> None:
        kport = procs.free_port()
        cmd = [sys.executable, "-m", "kvgate", "serve", "--upstream", upstream, "--port", str(kport),
               *kvgate_flags(self.scaled.kvgate_times), *shared]
        if self.sc.kvgate_extra:  # as a config file: YAML keeps every type (booleans, lists, null) intact
            extra_yaml = self.log_dir / "kvgate-extra.yaml"
            extra_yaml.parent.mkdir(parents=True, exist_ok=True)
            extra_yaml.write_text(yaml.safe_dump(dict(self.sc.kvgate_extra)))
            cmd += ["--config", str(extra_yaml)]
        cmd += ["--router-policy", self.policy]
        if self.arm.placement or (self.arm.lifecycle and self.sc.api in ("generate", "chat")):
            # kvgate keeps each session on one engine: what auto does with lifecycle on (said explicitly, so the
            # arm means the same with a config that sets session_placement)
            cmd += ["--session-placement", "kvgate"]
        if self.arm.lifecycle:
            cmd.append("--agentic-session-lifecycle")
        if self.arm.admission:
            cmd += ["--agentic-program-admission", "--admission-policy", self.arm.admission_policy]
            if not self.arm.host_cache:
                cmd.append("--no-admission-host-cache")
        cmd += list(self.arm.kvgate_flags)
        name = "kvgate" if self.arm.replicas == 1 else f"kvgate{index}"
        kv = procs.start(name, cmd, self.log_dir, url=f"http://127.0.0.1:{kport}")
        self.procs.append(kv)
        if self.kvgate_url is None:
            self.kvgate_url = kv.url
        if self.arm.replicas > 1:
            self.kvgate_urls.append(kv.url)
        n = len(self.engine_urls)
        procs.wait_http(kv.url + "/kvgate/engines", 30, kv,
                        lambda st, body: st == 200 and len(json.loads(body)["engines"]) == n)
        if self.arm.admission:  # start once the ledger has its first capacity snapshot
            procs.wait_http(kv.url + "/kvgate/stats", 30, kv,
                            lambda st, body: st == 200 and not json.loads(body)["ledger"]["degraded"])

    def router_command(self, port: int, prometheus_port: int) -> list[str]:
        """smg's command line for this arm: the scenario's policy and router_extra in every arm (and
        kvgate_router_extra in the arms with kvgate), the limiter flags in router-limit arms (queue timeout
        scaled by the speed factor), and the load-monitor interval scaled by it (kvgate.bench.speed)."""
        extra = split_load_monitor_interval(self.sc.router_extra)[0] + list(self.arm.router_flags)
        if self.arm.kvgate:
            extra += [str(x) for x in self.sc.kvgate_router_extra]
        extra += ["--load-monitor-interval", str(self.scaled.router_load_monitor_interval_s)]
        if self.arm.router_limit:
            extra += ["--max-concurrent-requests", str(self.arm.router_limit),
                      "--queue-size", str(self.sc.router_queue_size),
                      "--queue-timeout-secs", str(max(1, int(round(self.scaled.router_queue_timeout_s))))]
        if self.prefill:  # a PD fleet: smg's PD router (the policy for both sides unless router_extra says)
            decode = self.engine_urls[len(self.prefill):]
            return procs.smg_pd_command(port, self.prefill, decode, prometheus_port, policy=self.policy, extra=extra)
        return procs.smg_command(port, self.engine_urls, prometheus_port, policy=self.policy, extra=extra)

    @property
    def policy(self) -> str:
        return self.arm.router_policy or self.sc.router_policy

    def cpu_groups(self) -> dict[str, list[int]]:
        """The process groups of this fleet by role (engines, router, kvgate, other): what shares the host."""
        roles: dict[str, list[int]] = {"engines": [], "router": [], "kvgate": [], "other": []}
        if self.engine_pool is not None:
            roles["engines"] += [e.proc.popen.pid for e in self.engine_pool.engines]
        for p in self.procs:
            role = ("engines" if p.name.startswith("engine") else "router" if p.name == "smg"
                    else "kvgate" if p.name.startswith("kvgate") else "other")
            roles[role].append(p.popen.pid)
        return roles

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each role of :meth:`cpu_groups`, and by this process (``client``: the
        bench's client and sampler)."""
        roles = self.cpu_groups()
        used = procs.group_cpu_seconds([g for gs in roles.values() for g in gs])
        out = {role: sum(used.get(g, 0.0) for g in gs) for role, gs in roles.items()}
        t = os.times()
        out["client"] = t.user + t.system
        return out

    def stop(self) -> None:
        """Stop every process group, newest first."""
        procs.stop_all(self.procs)


class Recorder:
    """What the client saw, in wall seconds since ``t0``."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.requests: list[dict] = []
        self.sessions: list[dict] = []
        self.steps: list[dict] = []
        self.samples: list[dict] = []
        self.closes: dict[str, int] = {}

    def now(self) -> float:
        return time.monotonic() - self.t0


RETRY_STATUSES = (408, 429)   # smg's own limiter: queue timeout / queue full
RETRY_BACKOFF_S = 1.0          # seconds at speed 1 between retries of a rejected turn


def turn_body(api: str, prompt: str | list, max_tokens: int, rid: str | None, ignore_eos: bool = True) -> bytes:
    """One streamed turn's request body for ``api`` (generate | chat | completions); ``prompt`` is text, token
    ids (generate), or the message list for chat. ignore_eos=False asks for min_new_tokens = max_tokens instead
    (/generate only): the same output length, but the engine's scheduler treats the turn as one that may stop
    early (it reserves new_token_ratio of the rest, so decode can retract)."""
    extra = {"rid": rid} if rid else {}
    if api == "generate":
        ids = prompt if isinstance(prompt, list) else encode(prompt)
        stop = {"ignore_eos": True} if ignore_eos else {"min_new_tokens": max_tokens}
        return orjson.dumps({"input_ids": ids, "stream": True,
                             "sampling_params": {"max_new_tokens": max_tokens, **stop}, **extra})
    if api == "chat":
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return orjson.dumps({"model": "kvgate-sim", "messages": msgs, "max_tokens": max_tokens, "ignore_eos": True,
                             "stream": True, "stream_options": {"include_usage": True}, **extra})
    return orjson.dumps({"model": "kvgate-sim", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                         "stream": True, "stream_options": {"include_usage": True}, **extra})


API_PATHS = {"generate": "/generate", "chat": "/v1/chat/completions", "completions": "/v1/completions"}


def prompt_length(prompt: str | list) -> int:
    """Characters of a prompt (= simulator tokens for text), token ids, or a chat's message contents."""
    if isinstance(prompt, str) or (prompt and not isinstance(prompt[0], dict)):
        return len(prompt)
    return sum(len(m["content"]) for m in prompt)


async def send_turn(http: aiohttp.ClientSession, base: str, rec: Recorder, sid: str, turn: int,
                    prompt: str | list, max_tokens: int, scaled: Scaled | None = None, named: bool = True,
                    api: str = "generate", ignore_eos: bool = True) -> tuple[bool, str | list[int]]:
    """One streamed turn to ``api``'s route; appends a request record; returns (ok, output text).

    A 408/429 (smg's limiter shedding the request) is retried after RETRY_BACKOFF_S (scaled), as a rollout
    client behind that limiter must; the turn's latency and TTFT count from the first attempt and ``retries``
    counts the rejections. kvgate never answers 408/429 itself, so only router-limit arms retry.
    named=False sends no X-Session-ID (and no rid naming the session); the session kvgate assigned comes
    back in X-Kvgate-Session-Id and is recorded as ``kv_session`` for precision/recall.
    A prompt of token ids (a list, /generate) gets the output token ids back instead of the text."""
    body = turn_body(api, prompt, max_tokens, f"{sid}-turn{turn}" if named else None, ignore_eos)
    out_ids: list[int] = []
    r = {"session": sid, "turn": turn, "start": rec.now(), "ttft": None, "end": None, "ok": False,
         "status": None, "error": None, "output_tokens": 0, "prompt_tokens": None, "cached_tokens": None,
         "admission": None, "queue_ms": None, "prompt_len": prompt_length(prompt), "retries": 0, "kv_session": None}
    # a client that names its sessions also asks smg for session affinity (X-SMG-Routing-Key: read by smg's
    # manual policy, ignored by the others), as kvgate does for it when lifecycle is on
    headers = {"Content-Type": "application/json",
               **({"X-Session-ID": sid, "X-SMG-Routing-Key": sid} if named else {})}
    parts: list[str] = []
    while True:
        try:
            async with http.post(base + API_PATHS[api], data=body, headers=headers) as resp:
                r["status"] = resp.status
                r["kv_session"] = resp.headers.get("X-Kvgate-Session-Id")
                r["admission"] = resp.headers.get("X-Kvgate-Admission")
                if resp.headers.get("X-Kvgate-Queue-Ms") is not None:
                    r["queue_ms"] = float(resp.headers["X-Kvgate-Queue-Ms"])
                if resp.status in RETRY_STATUSES and scaled is not None:
                    await resp.read()
                    r["retries"] += 1
                    await asyncio.sleep(scaled.wall(RETRY_BACKOFF_S))
                    continue
                if resp.status != 200:
                    r["error"] = f"http {resp.status}: {(await resp.text())[:200]}"
                else:
                    async for line in resp.content:
                        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                            continue
                        obj = orjson.loads(line[6:])
                        if "error" in obj:
                            raise ValueError(f"stream error: {obj['error']}")
                        if api == "generate":  # cumulative text; usage in meta_info
                            if obj.get("text") and r["ttft"] is None:
                                r["ttft"] = rec.now()
                            parts = [obj.get("text") or ""]
                            out_ids = obj.get("output_ids") or out_ids  # cumulative, as the text
                            meta = obj.get("meta_info") or {}
                            r["prompt_tokens"] = meta.get("prompt_tokens")
                            r["output_tokens"] = meta.get("completion_tokens", 0)
                            r["cached_tokens"] = meta.get("cached_tokens")
                            r["retractions"] = meta.get("num_retractions")
                            continue
                        for ch in obj.get("choices") or []:
                            piece = ch.get("text") if api == "completions" else (ch.get("delta") or {}).get("content")
                            if piece:
                                if r["ttft"] is None:
                                    r["ttft"] = rec.now()
                                parts.append(piece)
                        if obj.get("usage"):
                            u = obj["usage"]
                            r["prompt_tokens"] = u.get("prompt_tokens")
                            r["output_tokens"] = u.get("completion_tokens", 0)
                            r["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
                    r["ok"] = True
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            r["error"] = f"{type(exc).__name__}: {exc}"[:200]
        break
    r["end"] = rec.now()
    text = "".join(parts)
    if r["ok"] and not r["output_tokens"]:
        r["output_tokens"] = len(text)
    rec.requests.append(r)
    if isinstance(prompt, list) and api == "generate":
        return r["ok"], list(out_ids)
    return r["ok"], text


async def _close(http: aiohttp.ClientSession, base: str, rec: Recorder, sid: str) -> None:
    """SGLang's POST /close_session through the base URL: kvgate answers it when lifecycle is on; the router
    does not proxy it (404). Sent in every arm so the workload is identical."""
    try:
        async with http.post(base + "/close_session", json={"session_id": sid}) as resp:
            await resp.read()
            key = str(resp.status)
    except aiohttp.ClientError as exc:
        key = type(exc).__name__
    rec.closes[key] = rec.closes.get(key, 0) + 1


# In a several-replica arm, every ALTERNATE-th session sends its turns to the replicas in turn (turn k to replica
# (i + k) mod n), so one agent's turns and its close cross replicas; the others stay on replica i mod n, as
# clients split over replicas by a load balancer with session affinity would.
ALTERNATE = 4


def replica_for(index: int, turn: int, replicas: int) -> int:
    """The replica (0-based) that session number ``index`` sends turn ``turn`` to (turn 0 = the first;
    len(turns) = its close): session i goes to replica i mod n, except every ALTERNATE-th session (i mod
    ALTERNATE == ALTERNATE - 1) whose turns go round the replicas."""
    if replicas <= 1:
        return 0
    step = turn if index % ALTERNATE == ALTERNATE - 1 else 0
    return (index + step) % replicas


async def run_agentic(base: str | list[str], plans: list[SessionPlan], scaled: Scaled, rec: Recorder,
                      explicit_close: bool, progress: Callable[[], None], named: bool = True,
                      api: str = "generate", ignore_eos: bool = True) -> None:
    """Closed loop: each step starts all its sessions at once and ends when the last one ends. On /generate
    the client keeps token ids, as an RL rollout does: the next prompt is the previous prompt's ids + the output
    ids the engine returned + the observation's ids (a real engine's output text need not re-tokenize to the
    ids it generated).
    named=False: no session ids and no closes from the client (kvgate infers and ends sessions).
    ``base``: one URL, or several kvgate replicas' URLs that the sessions are split between (replica_for)."""
    bases = [base] if isinstance(base, str) else list(base)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as http:

        async def session(i: int, p: SessionPlan) -> None:
            s = {"id": p.session_id, "step": p.step, "start": rec.now(), "end": None, "ok": False}
            rec.sessions.append(s)
            prompt: str | list[int] = encode(p.first_prompt) if api == "generate" else p.first_prompt
            msgs = [{"role": "user", "content": p.first_prompt}]
            ok = True
            for k, t in enumerate(p.turns):
                url = bases[replica_for(i, k, len(bases))]
                ok, out = await send_turn(http, url, rec, p.session_id, k + 1, msgs if api == "chat" else prompt,
                                          t.max_tokens, scaled, named, api, ignore_eos)
                progress()
                if not ok:
                    break
                if k < len(p.turns) - 1:
                    await asyncio.sleep(scaled.wall(t.gap_s))  # the tool runs (the closed loop's idle window)
                    prompt = (prompt + out + encode(t.observation) if api == "generate"
                              else next_prompt(prompt, out, t.observation))
                    msgs = msgs + [{"role": "assistant", "content": out}, {"role": "user", "content": t.observation}]
            s["end"], s["ok"] = rec.now(), ok
            if explicit_close and named:
                await _close(http, bases[replica_for(i, len(p.turns), len(bases))], rec, p.session_id)

        for step in sorted({p.step for p in plans}):
            st = {"step": step, "start": rec.now(), "end": None}
            rec.steps.append(st)
            await asyncio.gather(*(session(i, p) for i, p in enumerate(plans) if p.step == step))
            st["end"] = rec.now()


async def run_trace(base: str, reqs: list[TraceRequest], scaled: Scaled, rec: Recorder,
                    progress: Callable[[], None], named: bool = True, api: str = "generate") -> None:
    """Open loop: each request at its (scaled) trace time; the 'step' is the whole window."""
    conn = aiohttp.TCPConnector(limit=0)
    st = {"step": 0, "start": rec.now(), "end": None}
    rec.steps.append(st)
    sess: dict[str, dict] = {}
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as http:

        async def one(q: TraceRequest) -> None:
            delay = scaled.wall(q.t_s) - (rec.now() - st["start"])
            if delay > 0:
                await asyncio.sleep(delay)  # open loop: the trace's own timestamps
            s = sess.setdefault(q.session_id, {"id": q.session_id, "step": 0, "start": rec.now(), "end": None,
                                                "ok": True})
            ok, _ = await send_turn(http, base, rec, q.session_id, q.turn, q.prompt, q.max_tokens, scaled, named, api)
            s["ok"] = s["ok"] and ok
            s["end"] = max(s["end"] or 0.0, rec.now())
            progress()

        await asyncio.gather(*(one(q) for q in reqs))
    st["end"] = rec.now()
    rec.sessions.extend(sess.values())


async def sample_loop(engine_urls: list[str], scaled: Scaled, rec: Recorder, stop: asyncio.Event) -> None:
    """Every sample interval: each engine's KV usage, running and waiting requests (GET /v1/loads)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while not stop.is_set():
            t = rec.now()
            for i, u in enumerate(engine_urls):
                try:
                    async with http.get(u + "/v1/loads") as r:
                        loads = (await r.json())
                    loads = loads.get("loads", loads) if isinstance(loads, dict) else loads
                    used = sum(x["num_used_tokens"] for x in loads)
                    total = sum(x["max_total_num_tokens"] for x in loads)
                    rec.samples.append({"t": t, "engine": i, "usage": used / total if total else 0.0,
                                        "running": sum(x["num_running_reqs"] for x in loads),
                                        "waiting": sum(x["num_waiting_reqs"] for x in loads)})
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
                    pass
            try:
                await asyncio.wait_for(stop.wait(), timeout=scaled.sample_interval_s)
            except asyncio.TimeoutError:
                pass


async def _get_json(url: str):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        async with http.get(url) as r:
            return await r.json(content_type=None)


async def run_arm_async(fleet: Fleet, workload, scaled: Scaled, sc: Scenario, progress, timeout_s: float) -> dict:
    """Drive the workload against a started fleet; returns the raw record of the arm (see report.summarize)."""
    rec = Recorder()
    real = fleet.engine_pool is not None
    before = [sglang_fleet.scrape(u) for u in fleet.engine_urls] if real else None
    loadavg = [_loadavg()]
    cpu0 = fleet.cpu_seconds()
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_loop(fleet.engine_urls, scaled, rec, stop))
    timed_out = False
    try:
        if sc.workload["kind"] == "agentic":
            coro = run_agentic(fleet.bases, workload, scaled, rec, sc.explicit_close, progress,
                               fleet.arm.named_sessions, sc.api, sc.ignore_eos)
        else:
            coro = run_trace(fleet.base, workload, scaled, rec, progress, fleet.arm.named_sessions, sc.api)
        await asyncio.wait_for(coro, timeout=timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:
        stop.set()
        await sampler
    wall = rec.now()
    loadavg.append(_loadavg())
    cpu1 = fleet.cpu_seconds()
    cpu = {k: round(cpu1[k] - cpu0.get(k, 0.0), 2) for k in cpu1}
    if real:  # a real engine's counters, before and after this run (it has no /sim/stats)
        after = [sglang_fleet.scrape(u) for u in fleet.engine_urls]
        sims = [{"totals": {k: a[k] - b[k] for k in a}, "sessions": []} for a, b in zip(after, before)]
        totals = sglang_fleet.totals_delta(before, after)
    else:
        sims = [await _get_json(u + "/sim/stats") for u in fleet.engine_urls]
        totals = {}
        for s in sims:
            for k, v in s["totals"].items():
                totals[k] = totals.get(k, 0) + v
    kv_stats = None
    replicas: list[dict] | None = None
    if fleet.arm.admission and fleet.kvgate_url:
        every = [await _get_json(u + "/kvgate/stats") for u in (fleet.kvgate_urls or [fleet.kvgate_url])]
        kv_stats = every[0] if len(every) == 1 else _sum_stats(every)
        if len(every) > 1:
            replicas = [{"counters": st["counters"], "shared_leases": st.get("shared_leases")} for st in every]
    kv_health = await _get_json(fleet.kvgate_url + "/kvgate/health") if fleet.kvgate_url else None
    placement = None
    if fleet.kvgate_url:  # kvgate's placement counters (sticky, reopened, ...), summed over its replicas
        placement = {}
        for u in fleet.kvgate_urls or [fleet.kvgate_url]:
            for k, v in ((await _get_json(u + "/kvgate/engines")).get("placement") or {}).get("counts", {}).items():
                placement[k] = placement.get(k, 0) + v
    return {"arm": fleet.arm.name, "wall_s": wall, "timed_out": timed_out, "requests": rec.requests,
            "loadavg": loadavg, "cpu_s": cpu, "engine": "sglang" if real else "sim",
            "sessions": rec.sessions, "steps": rec.steps, "samples": rec.samples, "closes": rec.closes,
            "sim_totals": totals, "sim_engines_sessions_seen": None if real else [len(s["sessions"]) for s in sims],
            "sim_engines_prompt_tokens": [s["totals"]["prompt_tokens"] for s in sims],
            "sim_engines_session_ids": [sorted(s["sessions"]) for s in sims],
            "kvgate_counters": kv_stats["counters"] if kv_stats else None,
            "kvgate_ledger": kv_stats["ledger"] if kv_stats else None, "kvgate_health": kv_health,
            "kvgate_pause_gate": kv_stats.get("pause_gate") if kv_stats else None,
            "kvgate_replicas": replicas, "kvgate_placement": placement}


def _sum_stats(every: list[dict]) -> dict:
    """Several replicas' /kvgate/stats as one: their numeric counters summed (every request went through
    exactly one replica); the ledger is the first replica's."""
    counters: dict = {}
    for st in every:
        for k, v in st["counters"].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                counters[k] = counters.get(k, 0) + v
    return {"counters": counters, "ledger": every[0]["ledger"]}


def _loadavg() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages (/proc/loadavg; [] where there is none)."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def run_arm(sc: Scenario, arm: ArmSpec, scaled: Scaled, workload, log_dir: Path, progress,
            timeout_s: float, engine_pool=None) -> dict:
    """Start a fresh fleet for ``arm`` (real engines: the pool's, flushed), run the workload, collect, stop
    what the arm started. Returns the raw record."""
    fleet = Fleet(sc, arm, scaled, log_dir, engine_pool)
    t = time.monotonic()
    try:
        fleet.start()
        startup = time.monotonic() - t
        raw = asyncio.run(run_arm_async(fleet, workload, scaled, sc, progress, timeout_s))
        raw["startup_s"] = startup
        return raw
    finally:
        fleet.stop()
