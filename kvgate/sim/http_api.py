"""aiohttp HTTP surface of the simulated SGLang engine (thin shell over kvgate.sim.sim_engine).

Endpoints and shapes follow SGLang's srt/entrypoints/http_server.py and what smg 1.13 calls
(docs/compatibility.md): /health, /health_generate, /ready, /server_info,
/get_server_info, /model_info, /get_model_info, /v1/models, /v1/loads, /metrics, /generate,
/v1/completions, /v1/chat/completions, /open_session, /close_session, /flush_cache,
/abort_request, /update_weights_from_disk, and the simulator-only /sim/stats.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Optional

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from kvgate.sim import disagg
from kvgate.sim.request_checks import (GenSpec, HTTPError, ValidationError, _body, _check_sampling,
                                       _check_session_id, _err, _json, _params, _parallel_n, _sampling)
from kvgate.sim.sim_engine import EngineOptions, EngineStopped, RequestHandle, SimEngine
from kvgate.sim.exposition import render_loads_prometheus
from kvgate.sim.scheduler import Request
from kvgate.sim.tokenizer import decode, encode, render_chat

SIM_VERSION = {"0.5.17": "0.5.17", "0.5.15": "0.5.15"}

ENGINE_KEY = web.AppKey("sim_engine", SimEngine)

# On shutdown (SIGTERM) requests still in flight are ended with an abort at once; this is how long aiohttp then
# waits for their handlers to write that end before it cancels them and closes the connections (uvicorn, SGLang's
# HTTP server, likewise cancels what is left once its graceful-shutdown timeout expires).
SHUTDOWN_GRACE_S = 1.0


class _Http2ProbeFilter(logging.Filter):
    """Drops aiohttp's traceback for an HTTP/2 prior-knowledge preface (``PRI * HTTP/2.0``): smg sends one to
    every worker it registers; aiohttp already answers it 400 (HTTP/1.1 only, as SGLang's uvicorn), so the
    probe is expected and the traceback is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, BadHttpMessage) and "PRI/Upgrade" in str(exc))


def _quiet_http2_probe() -> None:
    log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _Http2ProbeFilter) for f in log.filters):
        log.addFilter(_Http2ProbeFilter())


class SimServer:
    """Builds the aiohttp application for one :class:`SimEngine`."""

    def __init__(self, engine: SimEngine):
        self.engine = engine
        self.opts = engine.opts
        self.start_time = time.time()
        # PD (kvgate/sim/disagg.py): a prefill worker's bootstrap rooms; a decode worker's client to reach them
        self.rendezvous = disagg.Rendezvous() if self.opts.disaggregation_mode == "prefill" else None
        self._pd_http: Optional[aiohttp.ClientSession] = None
        self._pd_tasks: set = set()

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[self._mw])
        app[ENGINE_KEY] = self.engine
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/ready", self.ready)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/loads", self.v1_loads)
        r.add_get("/get_load", self.v1_loads)
        r.add_get("/metrics", self.metrics)
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        for path, h in (("/open_session", self.open_session),
                        ("/close_session", self.close_session),
                        ("/flush_cache", self.flush_cache)):
            r.add_get(path, h)
            r.add_post(path, h)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/update_weights_from_disk", self.update_weights)
        r.add_get("/sim/stats", self.sim_stats)
        return app

    @web.middleware
    async def _mw(self, request, handler):
        try:
            return await handler(request)
        except ValidationError as e:
            return _json(e.body(), e.status)
        except HTTPError as e:
            return _err(e.status, e.message)

    # ------------------------------------------------------------------ info
    async def health(self, request):
        return web.Response(status=200)

    async def ready(self, request):
        return _json({"status": "ready"})

    def _server_args(self) -> dict:
        o, sc = self.opts, self.opts.scheduler
        return {
            # An empty model_path: smg 1.13 otherwise tries to fetch a tokenizer of that name from the
            # Hugging Face hub at registration (measured); there is no network here.
            "model_path": "", "tokenizer_path": None, "served_model_name": o.model_name,
            "skip_tokenizer_init": True, "is_embedding": False,
            "max_total_num_tokens": o.max_total_num_tokens,
            "max_running_requests": sc.max_running_requests,
            "max_prefill_tokens": sc.max_prefill_tokens,
            "chunked_prefill_size": sc.chunked_prefill_size,
            "schedule_policy": "fcfs", "schedule_conservativeness": sc.schedule_conservativeness,
            "page_size": 1, "tp_size": 1, "dp_size": o.dp_size, "pp_size": 1, "ep_size": 1,
            "enable_dp_attention": False, "disable_radix_cache": False,
            "enable_session_radix_cache": o.enable_session_radix_cache,
            "radix_eviction_policy": o.radix_eviction_policy,
            "enable_priority_scheduling": sc.enable_priority_scheduling, "random_seed": sc.random_seed,
            "enable_hierarchical_cache": o.enable_hierarchical_cache, "hicache_ratio": o.hicache_ratio,
            "hicache_size": o.hicache_size, "hicache_write_policy": o.hicache_write_policy,
            "enable_metrics": not o.disable_metrics, "disaggregation_mode": o.disaggregation_mode,
            "disaggregation_bootstrap_port": o.disaggregation_bootstrap_port,
            "disaggregation_decode_enable_radix_cache": o.disaggregation_mode == "decode",
            "context_length": o.max_total_num_tokens, "sim_speed": sc.speed,
            "version": SIM_VERSION[o.session_semantics], "kvgate_sim": True,
        }

    async def server_info(self, request):
        info = self._server_args()
        info["internal_states"] = [
            {"dp_rank": ld["dp_rank"], "last_gen_throughput": 0.0,
             # SGLang's get_internal_state: kvcache in GiB (the KV pool's bytes / 1024^3, 2 decimals)
             "memory_usage": {"token_capacity": ld["max_total_num_tokens"],
                              "kvcache": round(ld["max_total_num_tokens"] * self.opts.scheduler.kv_bytes_per_token
                                               / 1024 ** 3, 2)},
             "load": ld["num_used_tokens"], **ld}
            for ld in self.engine.loads()]
        return _json(info)

    async def model_info(self, request):
        return _json({"model_path": "", "tokenizer_path": None,
                      "is_generation": True, "preferred_sampling_params": None,
                      "weight_version": self.engine.weight_version,
                      "has_image_understanding": False, "has_audio_understanding": False,
                      "model_type": "llama", "architectures": ["LlamaForCausalLM"]})

    async def models(self, request):
        return _json({"object": "list", "data": [{
            "id": self.opts.model_name, "object": "model", "created": int(self.start_time),
            "owned_by": "sglang", "root": self.opts.model_name,
            "max_model_len": self.opts.max_total_num_tokens}]})

    async def v1_loads(self, request):
        self.engine.capacity_reads += 1
        loads = self.engine.loads()
        if request.query.get("format") == "prometheus":
            return web.Response(text=render_loads_prometheus(loads),
                                content_type="text/plain")
        return _json({"timestamp": time.time(), "dp_rank_count": len(loads), "loads": loads})

    async def metrics(self, request):
        if self.opts.disable_metrics:
            raise web.HTTPNotFound()
        self.engine.capacity_reads += 1
        return web.Response(body=self.engine.metrics_text().encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def sim_stats(self, request):
        return _json(self.engine.stats())

    # ------------------------------------------------------------------ sessions
    async def open_session(self, request):
        p = await _params(request)
        sid = p.get("session_id") or uuid.uuid4().hex
        self.engine.legacy_sessions.setdefault(str(sid), {"ids": None})
        return _json(str(sid))

    async def close_session(self, request):
        p = await _params(request)
        sid = p.get("session_id")
        if not sid:
            raise HTTPError(400, "session_id is required")
        self.engine.close_session(str(sid))
        return web.Response(status=200)

    async def flush_cache(self, request):
        if self.engine.flush_cache():
            return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                     "(When there are running or waiting requests, the operation "
                                     "will not be performed.)\n")
        return web.Response(status=400, text="Cache not flushed because there are pending "
                                             "requests.\n")

    async def abort_request(self, request):
        p = await _body(request)
        self.engine.abort(p.get("rid"), bool(p.get("abort_all")))
        return web.Response(status=200)

    async def update_weights(self, request):
        p = await _body(request)
        self.engine.abort(None, abort_all=True, message="Abort due to weight update")
        self.engine.flush_cache()
        if p.get("weight_version"):
            self.engine.weight_version = str(p["weight_version"])
        return _json({"success": True, "message": "Succeeded to update model weights.",
                      "num_paused_requests": 0})

    # ------------------------------------------------------------------ generate core
    def max_sequences_per_request(self) -> int:
        """The most sequences (prompts x n) one request may expand to: the tokens of the KV pools,
        max_total_num_tokens x dp_size (each sequence holds at least one token of KV of its own), far above any
        rollout's batch x n. SGLang sets no such bound (io_struct.py GenerateReqInput._normalize_batch_inputs
        copies the prompt, rid and sampling params batch_size x n times, and tokenizer_manager sends one request per
        copy, before any check): a huge n exhausts its host memory. The simulator refuses larger requests up
        front so a huge n costs nothing (docs/simulator.md)."""
        return self.opts.max_total_num_tokens * len(self.engine.ranks)

    def _check_sequences(self, prompts: int, n: int) -> None:
        """Raise HTTPError 400 when ``prompts`` x ``n`` exceeds :meth:`max_sequences_per_request`; called before
        anything per sequence is built."""
        cap = self.max_sequences_per_request()
        if prompts * n > cap:
            raise HTTPError(400, f"The request expands to {prompts * n} sequences ({prompts} prompt(s) x n={n}), "
                                 f"more than the {cap} tokens of the KV pools (max_total_num_tokens x dp_size).")

    def _specs(self, body: dict) -> tuple[list[GenSpec], bool]:
        """Normalise a /generate body into per-request specs; returns (specs, is_batch)."""
        _check_session_id(body)
        if "session_id" in body and body.get("session_params") is not None:
            raise HTTPError(400, "session_id and session_params cannot both be set.")
        given = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
        if len(given) != 1:
            raise HTTPError(400, "Either text, input_ids or input_embeds should be provided.")
        if given[0] == "input_embeds":
            raise HTTPError(400, "input_embeds is not supported by the simulator")
        if given[0] == "text":
            t = body["text"]
            batch = isinstance(t, list)
            prompts = [encode(str(x)) for x in (t if batch else [t])]
        else:
            ids = body["input_ids"]
            if not isinstance(ids, list):
                raise HTTPError(400, "input_ids must be a list")
            batch = bool(ids) and isinstance(ids[0], list)
            prompts = ids if batch else [ids]
            for p in prompts:
                if not isinstance(p, list) or not all(
                        isinstance(x, int) and not isinstance(x, bool) for x in p):
                    raise HTTPError(400, "input_ids must be a list of ints (or list of lists)")
        n_req = len(prompts)
        sps = body.get("sampling_params")
        sps = sps if isinstance(sps, list) else [sps] * n_req
        if len(sps) != n_req:
            raise HTTPError(400, "sampling_params list length does not match the batch")
        sps = [_check_sampling(sp) for sp in sps]
        ns = [_parallel_n(sp.get("n")) for sp in sps]
        if any(x != ns[0] for x in ns):
            # io_struct.py GenerateReqInput._handle_parallel_sampling
            raise HTTPError(400, "The parallel_sample_num should be the same for all samples in sample params.")
        self._check_sequences(n_req, ns[0] if ns else 1)
        rids = body.get("rid")
        if isinstance(rids, list):
            if len(rids) != n_req:
                raise HTTPError(400, "rid list length does not match the batch")
        else:
            rids = [rids if not batch else (f"{rids}_{i}" if rids else None)
                    for i in range(n_req)]
        dp = body.get("routed_dp_rank", body.get("data_parallel_rank"))
        if dp is not None and (not isinstance(dp, int) or isinstance(dp, bool)):
            raise HTTPError(400, "routed_dp_rank must be an int")
        prio = body.get("priority") or 0
        sid = body.get("session_id")
        sid = str(sid) if sid not in (None, "") else None
        legacy = body.get("session_params")
        specs: list[GenSpec] = []
        for i, (ids, sp, n) in enumerate(zip(prompts, sps, ns)):
            for j in range(n):
                rid = rids[i]
                if n > 1:
                    rid = f"{rid}_{j}" if rid else None
                mnt = sp.get("max_new_tokens")
                temp, seed = _sampling(sp.get("temperature"), sp.get("top_k"), sp.get("sampling_seed"))
                specs.append(GenSpec(list(ids), 128 if mnt is None else mnt,
                                     bool(sp.get("ignore_eos", False)), rid, sid, int(prio), dp,
                                     legacy if isinstance(legacy, dict) else None, temp, seed))
        return specs, batch or len(specs) > 1

    def _submit(self, spec: GenSpec) -> RequestHandle:
        ids = spec.input_ids
        if spec.legacy_session is not None:
            lsid = str(spec.legacy_session.get("id"))
            sess = self.engine.legacy_sessions.get(lsid)
            if sess is None:
                raise HTTPError(400, f"Invalid request: session id {lsid} does not exist")
            prev = sess["ids"] or []
            off = spec.legacy_session.get("offset")
            if off is not None and off >= 0:
                prev = prev[:off]
            if spec.legacy_session.get("replace"):
                prev = []
            ids = list(prev) + list(ids)
        req = Request(rid=spec.rid or uuid.uuid4().hex, input_ids=ids,
                      max_new_tokens=spec.max_new_tokens, ignore_eos=spec.ignore_eos,
                      session_id=spec.session_id or (str(spec.legacy_session.get("id"))
                                                     if spec.legacy_session else None),
                      priority=spec.priority, temperature=spec.temperature,
                      sampling_seed=spec.sampling_seed, kv_transferred=spec.kv_transferred)
        try:
            h = self.engine.submit(req, spec.dp_rank)
        except EngineStopped as e:
            raise HTTPError(503, str(e))
        except ValueError as e:
            raise HTTPError(400, str(e))
        if spec.legacy_session is not None:
            h.legacy_sid = str(spec.legacy_session.get("id"))
        return h

    def _after_finish(self, h: RequestHandle) -> None:
        lsid = getattr(h, "legacy_sid", None)
        if lsid and lsid in self.engine.legacy_sessions:
            self.engine.legacy_sessions[lsid]["ids"] = list(h.req.input_ids) + h.req.output_ids

    def _meta(self, h: RequestHandle, finished: bool) -> dict:
        r = h.req
        return {
            "id": r.rid,
            "finish_reason": r.finish_reason if finished else None,
            "prompt_tokens": len(r.input_ids),
            "weight_version": self.engine.weight_version,
            "num_retractions": r.num_retractions,
            "completion_tokens": len(r.output_ids),
            "cached_tokens": r.cached_tokens,
            "e2e_latency": ((r.finish_time or self.engine.clock()) - r.arrival_time),
            "dp_rank": h.dp_rank,
        }

    def _out(self, h: RequestHandle, finished: bool, ids: Optional[list] = None) -> dict:
        ids = list(h.req.output_ids if ids is None else ids)
        meta = self._meta(h, finished)
        meta["completion_tokens"] = len(ids)
        return {"text": decode(ids), "output_ids": ids, "meta_info": meta}

    async def _wait(self, handles: list[RequestHandle]) -> None:
        try:
            await asyncio.gather(*(h.wait() for h in handles))
        except asyncio.CancelledError:
            for h in handles:
                if not h.req.finished:
                    self.engine.abort(h.req.rid, message="Client disconnected")
            raise
        for h in handles:
            self._after_finish(h)

    @staticmethod
    def _status(handles: list[RequestHandle]) -> int:
        for h in handles:
            fr = h.req.finish_reason or {}
            if fr.get("type") == "abort" and fr.get("status_code"):
                return int(fr["status_code"])
        return 200

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    async def _stream_handles(self, request, handles, render_chunk, render_final=None,
                              done_chunk=None) -> web.StreamResponse:
        """Stream every handle's events as SSE (interleaved by arrival); then [DONE]."""
        resp = await self._sse(request)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, h):
            while True:
                ev = await h.next_event()
                await queue.put((i, h, ev))
                if ev.finished:
                    return

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        remaining = len(handles)
        emitted = [0] * len(handles)
        try:
            while remaining:
                i, h, ev = await queue.get()
                emitted[i] += len(ev.new_ids)
                ids = h.req.output_ids[:emitted[i]]
                if ev.finished:
                    remaining -= 1
                    self._after_finish(h)
                    fr = h.req.finish_reason or {}
                    if fr.get("type") == "abort" and fr.get("status_code") in (500, 503):
                        # out of memory (500) or the server shutting down (503): an error event, then [DONE]
                        await resp.write(b"data: " + orjson.dumps(
                            {"error": {"message": fr.get("message"), "code": fr["status_code"]}}) + b"\n\n")
                        continue
                for payload in render_chunk(i, h, ev, ids):
                    await resp.write(b"data: " + orjson.dumps(payload) + b"\n\n")
            if done_chunk is not None:
                for payload in done_chunk():
                    await resp.write(b"data: " + orjson.dumps(payload) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError, ConnectionError):
            for h in handles:
                if not h.req.finished:
                    self.engine.abort(h.req.rid, message="Client disconnected")
            raise
        finally:
            for t in tasks:
                t.cancel()
        return resp

    def _submit_all(self, specs) -> list:
        """Submit every sequence of a request, or none: a bad one aborts those already submitted."""
        handles = []
        try:
            for s in specs:
                handles.append(self._submit(s))
        except HTTPError:
            for h in handles:
                self.engine.abort(h.req.rid)
            raise
        return handles

    # ------------------------------------------------------------------ PD (kvgate/sim/disagg.py)
    async def _pd_submit_all(self, body: dict, specs: list) -> list:
        """``_submit_all`` for every disaggregation mode: a prefill worker runs each sequence to its first token
        and marks its bootstrap room done (failed when it aborts); a decode worker first waits for each room's
        prefill and for the KV transfer. Raises HTTPError 400 (no or a malformed bootstrap room) or 500 (the
        transfer failed)."""
        mode = self.opts.disaggregation_mode
        if mode == "null":
            return self._submit_all(specs)
        try:
            rooms = disagg.rooms_of(body, len(specs))
            addrs = [disagg.bootstrap_address(body, i) for i in range(len(specs))] if mode == "decode" else []
        except ValueError as e:
            raise HTTPError(400, str(e))
        if mode == "prefill":
            for s in specs:
                s.max_new_tokens = min(s.max_new_tokens, 1)
            try:
                handles = self._submit_all(specs)
            except HTTPError:
                for room in rooms:
                    self.rendezvous.finish(room, None)
                raise
            for room, h in zip(rooms, handles):
                t = asyncio.get_running_loop().create_task(self._pd_prefill_done(room, h))
                self._pd_tasks.add(t)
                t.add_done_callback(self._pd_tasks.discard)
            return handles
        if self._pd_http is None:
            self._pd_http = aiohttp.ClientSession()
        timeout_s = self.opts.disaggregation_bootstrap_timeout_s
        try:
            await asyncio.gather(*(disagg.fetch_room(self._pd_http, host, port, room, timeout_s)
                                   for (host, port), room in zip(addrs, rooms)))
        except disagg.TransferFailed as e:
            raise HTTPError(500, f"KV transfer failed: {e}")
        tokens = sum(len(s.input_ids) - self._decode_cached(s) for s in specs)
        self.engine.pd_rooms += len(specs)
        self.engine.pd_transferred_tokens += tokens
        await asyncio.sleep(disagg.transfer_seconds(tokens, self.opts.disaggregation_transfer_us_per_token,
                                                    self.opts.scheduler.speed))
        for s in specs:
            s.kv_transferred = True
        return self._submit_all(specs)

    def _decode_cached(self, spec: GenSpec) -> int:
        """Tokens of ``spec``'s prompt the decode worker's radix cache holds now (its rank's, else the best
        rank's): the part the prefill worker need not send."""
        ranks = self.engine.ranks
        if spec.dp_rank is not None and 0 <= spec.dp_rank < len(ranks):
            ranks = [ranks[spec.dp_rank]]
        ids = spec.input_ids
        return min(max(r.cache.cached_len(ids) for r in ranks), max(len(ids) - 1, 0))

    async def _pd_prefill_done(self, room: int, h: RequestHandle) -> None:
        req = await h.wait()
        aborted = (req.finish_reason or {}).get("type") == "abort"
        if not aborted:
            self.engine.pd_rooms += 1
        self.rendezvous.finish(room, None if aborted else {"prompt_tokens": len(req.input_ids),
                                                           "cached_tokens": req.cached_tokens})

    async def close_pd(self) -> None:
        """Close the decode worker's client (shutdown)."""
        if self._pd_http is not None:
            await self._pd_http.close()

    # ------------------------------------------------------------------ /generate
    async def generate(self, request):
        body = await _body(request)
        specs, is_batch = self._specs(body)
        handles = await self._pd_submit_all(body, specs)
        lp = body.get("return_logprob")
        logprobs = any(lp) if isinstance(lp, list) else bool(lp)
        if body.get("stream"):
            def chunk(i, h, ev, ids):
                out = self._out(h, ev.finished, ids)
                if is_batch:
                    out["index"] = i
                return [with_logprobs(out) if logprobs else out]
            return await self._stream_handles(request, handles, chunk)
        await self._wait(handles)
        outs = [self._out(h, True) for h in handles]
        if logprobs:
            outs = [with_logprobs(o) for o in outs]
        status = self._status(handles)
        if status != 200:
            fr = next(h.req.finish_reason for h in handles
                      if (h.req.finish_reason or {}).get("status_code"))
            return _json({"error": {"message": fr["message"]}, **(outs[0] if not is_batch
                                                                    else {})}, status)
        return _json(outs if is_batch else outs[0])

    # ------------------------------------------------------------------ OpenAI
    @staticmethod
    def _oa_finish(req: Request) -> Optional[str]:
        fr = req.finish_reason
        if fr is None:
            return None
        return {"length": "length", "stop": "stop"}.get(fr["type"], "abort")

    def _oa_specs(self, body: dict, ids_list: list[list[int]], max_default: Optional[int]) -> list[GenSpec]:
        """GenSpecs of an OpenAI request. Without max_tokens / max_completion_tokens a chat request runs to
        the context length (protocol.py ChatCompletionRequest: max_new_tokens None; scheduler.py
        init_req_max_new_tokens clips it to the pool), a completion to 16 (CompletionRequest.max_tokens)."""
        # The OpenAI routes accept session_params but never pass it on (0.5.23 serving_chat.py and
        # serving_completions.py build GenerateReqInput with session_id only): no both-fields 400 here.
        _check_session_id(body)
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        mt = (max_default if max_default is not None else 1 << 30) if mt is None else mt
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 0:
            raise HTTPError(400, "max_tokens must be a non-negative integer")
        temp, seed = _sampling(body.get("temperature"), body.get("top_k"), body.get("seed"))
        n = _parallel_n(body.get("n"))
        self._check_sequences(len(ids_list), n)
        sid = body.get("session_id")
        prio = body.get("priority") or 0
        dp = body.get("routed_dp_rank", body.get("data_parallel_rank"))
        rid = body.get("rid")
        specs = []
        for i, ids in enumerate(ids_list):
            for j in range(n):
                r = rid if (rid and len(ids_list) * n == 1) else (f"{rid}_{i}_{j}" if rid else None)
                specs.append(GenSpec(ids, mt, bool(body.get("ignore_eos", False)), r,
                                     str(sid) if sid else None, int(prio), dp, None, temp, seed))
        return specs

    def _usage(self, handles, n: int = 1) -> dict:
        """OpenAI usage block (usage_processor.py): prompt and cached tokens count once per prompt (the first
        of its ``n`` choices), completion tokens for every choice."""
        n = max(int(n or 1), 1)
        firsts = [h for i, h in enumerate(handles) if i % n == 0]
        p = sum(len(h.req.input_ids) for h in firsts)
        c = sum(len(h.req.output_ids) for h in handles)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": sum(h.req.cached_tokens
                                                               for h in firsts)},
                "reasoning_tokens": 0, "completion_tokens_details": None}

    async def completions(self, request):
        body = await _body(request)
        prompt = body.get("prompt")
        if prompt is None:
            raise HTTPError(400, "prompt is required")
        if isinstance(prompt, str):
            ids_list = [encode(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            ids_list = [prompt]
        elif isinstance(prompt, list) and all(isinstance(x, str) for x in prompt):
            ids_list = [encode(x) for x in prompt]
        elif isinstance(prompt, list) and all(isinstance(x, list) for x in prompt):
            ids_list = prompt
        else:
            raise HTTPError(400, "invalid prompt")
        return await self._openai(request, body, ids_list, 16, chat=False)

    async def chat_completions(self, request):
        body = await _body(request)
        try:
            text = render_chat(body.get("messages"))
        except ValueError as e:
            raise HTTPError(400, str(e))
        return await self._openai(request, body, [encode(text)], None, chat=True)

    async def _openai(self, request, body, ids_list, max_default, chat: bool):
        specs = self._oa_specs(body, ids_list, max_default)
        handles = await self._pd_submit_all(body, specs)
        created = int(time.time())
        model = body.get("model") or self.opts.model_name
        cid = ("chatcmpl-" if chat else "cmpl-") + (handles[0].req.rid if handles else "")
        obj = "chat.completion" if chat else "text_completion"
        if body.get("stream"):
            sent_len = [0] * len(handles)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            def chunk(i, h, ev, ids):
                text = decode(ids)
                delta, sent_len[i] = text[sent_len[i]:], len(text)
                fin = self._oa_finish(h.req) if ev.finished else None
                if chat:
                    ch = {"index": i, "delta": {"role": "assistant", "content": delta},
                          "finish_reason": fin, "logprobs": None}
                else:
                    ch = {"index": i, "text": delta, "finish_reason": fin, "logprobs": None}
                return [{"id": cid, "object": obj + ("" if not chat else ".chunk"),
                         "created": created, "model": model, "choices": [ch]}]

            def done_chunk():
                if not include_usage:
                    return []
                return [{"id": cid, "object": obj + (".chunk" if chat else ""),
                         "created": created, "model": model, "choices": [],
                         "usage": self._usage(handles, body.get("n"))}]
            return await self._stream_handles(request, handles, chunk, done_chunk=done_chunk)
        await self._wait(handles)
        status = self._status(handles)
        if status != 200:
            fr = next(h.req.finish_reason for h in handles
                      if (h.req.finish_reason or {}).get("status_code"))
            return _json({"object": "error", "message": fr["message"], "type": "InternalError",
                          "code": status}, status)
        choices = []
        for i, h in enumerate(handles):
            text = decode(h.req.output_ids)
            fr = h.req.finish_reason or {}
            c = {"index": i, "logprobs": None, "finish_reason": self._oa_finish(h.req),
                 "matched_stop": fr.get("matched")}
            if chat:
                c["message"] = {"role": "assistant", "content": text, "tool_calls": None,
                                "reasoning_content": None}
            else:
                c["text"] = text
            choices.append(c)
        return _json({"id": cid, "object": obj, "created": created, "model": model,
                      "choices": choices, "usage": self._usage(handles, body.get("n")),
                      "metadata": {"weight_version": self.engine.weight_version}})


# ---------------------------------------------------------------------- logprobs
def sim_logprob(token_id: int, position: int) -> float:
    """A deterministic stand-in for a token's log-probability (nats, in (-5, 0]): same token at the same
    output position, same value, so answers through a proxy and direct compare exactly."""
    return -((token_id * 2654435761 + position * 40503) % 1000) / 200.0


def with_logprobs(out: dict) -> dict:
    """``out`` (one /generate answer) with meta_info.output_token_logprobs as SGLang writes it for
    ``return_logprob``: one [logprob, token_id, None] per output token, the text left None as without
    return_text_in_logprobs (srt/managers/tokenizer_manager.py, detokenize_logprob_tokens)."""
    out["meta_info"]["output_token_logprobs"] = [[sim_logprob(t, i), t, None]
                                                 for i, t in enumerate(out["output_ids"])]
    return out


# ---------------------------------------------------------------------- in-process helper
class SimEngineHandle:
    """A running in-process simulator: ``.url``, ``.port``, ``.engine``, ``.stats()``,
    ``await .close()``."""

    def __init__(self, engine: SimEngine, runner: web.AppRunner, host: str, port: int,
                 bootstrap: Optional[web.AppRunner] = None):
        self.engine = engine
        self.runner = runner
        self.bootstrap = bootstrap  # a prefill worker's bootstrap server (PD)
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"

    def stats(self) -> dict:
        """Same JSON as GET /sim/stats."""
        return self.engine.stats()

    async def close(self) -> None:
        """Stop listening, end the requests in flight (see SimEngine.stop), wait up to SHUTDOWN_GRACE_S seconds
        for their handlers, then cancel what is left and close every connection."""
        await self.runner.cleanup()  # its on_shutdown hook stops the engine
        if self.bootstrap is not None:
            await self.bootstrap.cleanup()


def build_options(**opts) -> EngineOptions:
    """EngineOptions from keyword options: engine fields (max_total_num_tokens,
    session_semantics, enable_session_radix_cache, radix_eviction_policy, dp_size, tp_copies,
    disable_metrics, model_name, enable_hierarchical_cache, hicache_ratio, hicache_size,
    hicache_write_policy, host_board, host_contention_prefill, host_contention_decode) and SchedulerConfig
    fields (speed, prefill_tokens_per_s, decode_base_ms, decode_per_seq_ms, decode_per_ctx_token_us,
    max_running_requests, chunked_prefill_size, max_prefill_tokens, eos_rate, schedule_conservativeness,
    enable_priority_scheduling, new_token_ratio_semantics, random_seed, the prefill context
    constants, kv_bytes_per_token, hicache_h2d_bytes_per_s). Raises TypeError on unknown keys."""
    from dataclasses import fields

    from kvgate.sim.scheduler import SchedulerConfig
    eng_keys = {f.name for f in fields(EngineOptions)} - {"scheduler"}
    sch_keys = {f.name for f in fields(SchedulerConfig)}
    unknown = set(opts) - eng_keys - sch_keys
    if unknown:
        raise TypeError(f"unknown sim options: {sorted(unknown)}")
    sc = SchedulerConfig(**{k: v for k, v in opts.items() if k in sch_keys and v is not None})
    return EngineOptions(scheduler=sc,
                         **{k: v for k, v in opts.items() if k in eng_keys and v is not None})


async def start_sim_engine(host: str = "127.0.0.1", port: int = 0, **opts) -> SimEngineHandle:
    """Start a simulator in the running event loop on ``host:port`` (0 = a free port).
    ``opts`` as in :func:`build_options`. Raises SessionConfigError for 0.5.15 semantics with
    the session cache on and radix_eviction_policy != "priority" (SGLang refuses to start)."""
    options = build_options(**opts)
    if options.disaggregation_mode not in disagg.MODES:
        raise ValueError(f"disaggregation_mode must be one of {disagg.MODES}, got {options.disaggregation_mode!r}")
    _quiet_http2_probe()
    engine = SimEngine(options)
    engine.start()
    server = SimServer(engine)
    app = server.app()
    bootstrap = None
    if server.rendezvous is not None:
        bootstrap = await disagg.start_bootstrap_server(server.rendezvous, host,
                                                        options.disaggregation_bootstrap_port)

    async def _end_in_flight(_app: web.Application) -> None:
        # Runs after the listening socket closed and before aiohttp waits for the handlers: streams and waiting
        # requests get their abort now, instead of aiohttp waiting out its timeout for events that never come.
        await engine.stop()
        await server.close_pd()
    app.on_shutdown.append(_end_in_flight)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    real_port = runner.addresses[0][1]
    return SimEngineHandle(engine, runner, host, real_port, bootstrap)
