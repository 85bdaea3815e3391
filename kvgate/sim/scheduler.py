"""Pure SGLang scheduler model: waiting queue, PrefillAdder admission, continuous batching,
chunked prefill, decode retraction and a compute-time model. No I/O, no asyncio.

Rules follow docs/simulator-fidelity.md ("KV pool and radix cache") and
the SGLang files: srt/managers/schedule_policy.py (PrefillAdder, CLIP_MAX_NEW_TOKENS),
srt/managers/schedule_batch.py (retract_decode, check_decode_mem), srt/managers/scheduler.py
(get_next_batch_to_run: a prefill batch, when one can be formed, runs before decode),
srt/mem_cache/radix_cache.py (cache_finished_req).

Usage (driving the core directly)::

    sched = Scheduler(RadixCache(10_000), SchedulerConfig(), clock=fake_clock)
    sched.add_request(Request(rid="a", input_ids=(1, 2, 3), max_new_tokens=8))
    while (batch := sched.schedule()) is not None:
        fake_clock.advance(batch.duration_s)
        sched.commit(batch)
    events = sched.pop_events()
"""

from __future__ import annotations

import hashlib
import random
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from kvgate.sim.radix import RadixCache, TreeNode

VOCAB_SIZE = 32000
PRINTABLE_FIRST_ID = 3 + 0x20     # token id of byte 0x20 (space) in kvgate.sim.tokenizer
PRINTABLE_COUNT = 0x7F - 0x20     # printable ASCII bytes 0x20..0x7e
EOS_ID = 2
CLIP_MAX_NEW_TOKENS = 4096          # schedule_policy.py CLIP_MAX_NEW_TOKENS_ESTIMATION
RETRACT_DECODE_STEPS = 20           # schedule_batch.py retract_decode
NEW_TOKEN_RATIO_DECAY_STEPS = 600   # server_args default_new_token_ratio_decay_steps
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14   # global_config min_new_token_ratio factor
OOM_MESSAGE = "Out of memory even after retracting all other requests"
NEW_TOKEN_RATIO_SEMANTICS = ("0.5.17", "0.5.23")
# HiCache host <-> device copies go over PCIe Gen5 x16 on an H100 SXM: 64 GB/s per direction on paper
# (NVIDIA H100 datasheet: 128 GB/s bidirectional); pinned-memory copies reach ~50 GB/s, the default here.
DEFAULT_H2D_BYTES_PER_S = 50e9

# --- compute-time model calibration -------------------------------------------------------
# Reference: Llama-3-8B (bf16, 32 layers, 8 KV heads x 128 dim) served by SGLang on ONE H100
# SXM 80GB (989 TFLOP/s dense bf16, 3.35 TB/s HBM3). These are APPROXIMATIONS derived from the
# datasheet and the model config, roughly consistent with published SGLang benchmark numbers;
# nothing was measured on a GPU here.
# * prefill: 2 * 8e9 FLOP/token = 16 GFLOP/token; at ~35% MFU (~350 TFLOP/s) -> ~20k tokens/s.
DEFAULT_PREFILL_TOKENS_PER_S = 20000.0
# * decode base: reading 16 GB of weights at ~3 TB/s effective ~ 5.3 ms + launch/sampling
#   overhead with CUDA graphs -> ~6 ms per step at batch 1 (SGLang bs=1 ITL ~6-7 ms).
DEFAULT_DECODE_BASE_MS = 6.0
# * per sequence: sampling, logits (128k vocab) and GEMM growth -> ~0.03 ms per running request.
DEFAULT_DECODE_PER_SEQ_MS = 0.03
# * per context token: KV bytes/token = 2 (K,V) * 32 layers * 8 heads * 128 dim * 2 B = 128 KiB;
#   read at ~2.6 TB/s effective -> ~0.05 us per cached token attended per step.
DEFAULT_DECODE_PER_CTX_TOKEN_US = 0.05

# Named compute profiles: (prefill tokens/s, decode base ms, decode ms per running request, decode us per
# context token) at speed 1. Same method as above; nothing measured on a GPU here.
# * qwen2.5-32b-h100: Qwen2.5-32B (bf16, 32.5B params, 64 layers, 8 KV heads x 128 dim) on ONE H100 SXM 80GB,
#   the usual SWE-agent RL policy size. prefill: 2 x 32.5e9 = 65 GFLOP/token at ~350 TFLOP/s -> ~5.4k tokens/s;
#   decode base: 65.5 GB of weights at ~3 TB/s -> ~21.8 ms + ~1 ms overhead -> 23 ms; per sequence: twice the
#   8B figure (hidden 5120 vs 4096, 64 vs 32 layers) -> 0.06 ms; per context token: KV bytes/token = 2 x 64
#   layers x 8 heads x 128 dim x 2 B = 256 KiB at ~2.6 TB/s -> ~0.1 us. Its KV pool is small: SGLang's default
#   mem_fraction_static on an 80 GB GPU is (80 GB - reserved_mem) / 80 GB ~ 0.84 (server_args.py
#   _handle_gpu_memory_settings: reserved_mem = 512 MB + chunked_prefill_size x 1.5 MB + tp/8 GB + cuda-graph
#   buffers ~ 13 GB), so 0.84 x 79.6 GiB = 66.9 GiB minus 61 GiB (65.5 GB) of weights leaves ~6 GiB: ~20k-24k
#   KV tokens at 256 KiB each; 48k (the kv-bound bench scenario) needs --mem-fraction-static ~0.91.
COMPUTE_PROFILES = {
    "llama-3-8b-h100": (DEFAULT_PREFILL_TOKENS_PER_S, DEFAULT_DECODE_BASE_MS, DEFAULT_DECODE_PER_SEQ_MS,
                        DEFAULT_DECODE_PER_CTX_TOKEN_US),
    "qwen2.5-32b-h100": (5400.0, 23.0, 0.06, 0.1),
    # * sglang-cpu-mlp: MEASURED, not derived: SGLang 0.5.23 on one core of this project's 2-core machine with
    #   nothing else running (load average 0.8-1.4), the `mlp` model (kvgate/tools/sglang_cpu/make_model.py) cut
    #   to 2 layers, float32, random weights, as configs/bench/real-programs.yaml runs it; least-squares fits of
    #   scripts/fit_engine_profile.py (samples in docs/simulator-fidelity.md): prefill 2,138 tokens/s, decode
    #   18.2 ms + 0.71 ms per running request + 3.42 us per context token. (The same fit at load 9-14 gave
    #   493 tokens/s and 41.5 ms + 4.35 ms + 3.19 us: on a busy host scale it with --compute-scale.)
    "sglang-cpu-mlp": (2138.0, 18.2, 0.71, 3.42),
}

# Context terms of the same profiles: (prefill attention FLOPs per extended token per attended context token,
# prefill weight FLOPs per token, minimum ms of any forward pass, KV bytes per token).
# * attention: QK^T and PV are 2 matmuls of 2 FLOPs per (query, key) pair per head dim: 4 x layers x q_heads
#   x head_dim per context token. Llama-3-8B: 4 x 32 x 32 x 128 = 524,288; Qwen2.5-32B: 4 x 64 x 40 x 128 =
#   1,310,720 (config.json num_hidden_layers, num_attention_heads, head_dim). Against 2 x params weight FLOPs
#   (16e9 / 65e9) a 30k-token prefix adds +98% / +60% to a prefilled token.
# * every forward pass reads all weights from HBM at least once: 16 GB / 65.5 GB at ~3 TB/s -> 5.3 / 21.8 ms.
# * KV bytes per token (bf16): 2 (K, V) x layers x kv_heads x head_dim x 2 B = 131,072 (8B) / 262,144 (32B).
PROFILE_CONTEXT = {
    "llama-3-8b-h100": (524288.0, 16e9, 5.3, 131072),
    "qwen2.5-32b-h100": (1310720.0, 65e9, 21.8, 262144),
    # * sglang-cpu-mlp: weights 2 x 13.9M params (2 layers of 4 x 512 x 256 attention + 3 x 512 x 4096 MLP, the
    #   lm_head 512 x 512) = 2.8e7 FLOPs per token; the attention constant is the fit's 2.34e-8 s per
    #   (context)^2 / 2 query-key pairs x 2,138 tokens/s x 2.8e7 = 1,400 (the FLOP count is 4 x 2 x 4 x 64 =
    #   2,048: the CPU's SDPA runs near its matmuls' rate); no minimum pass time (the per-batch cost is
    #   PROFILE_OPTIONS' prefill_base_ms); KV 2 x 2 layers x 4 heads x 64 x 4 B (float32) = 4,096 bytes a token.
    "sglang-cpu-mlp": (1400.0, 2.8e7, 0.0, 4096),
}
# Options only some profiles set (SchedulerConfig field -> value); see the fields' comments.
# * sglang-cpu-mlp: the CPU engine's torch_native attention covers the whole context of every prefilled request;
#   every prefill batch costs 59.5 ms on top (the fit's intercept: scheduling, the forward's fixed cost and the
#   HTTP and tokenizer-manager hops of a request).
PROFILE_OPTIONS: dict[str, dict] = {"llama-3-8b-h100": {}, "qwen2.5-32b-h100": {},
                                    "sglang-cpu-mlp": {"prefill_attention_whole_context": True,
                                                       "prefill_base_ms": 59.5}}


class TokenModel:
    """Deterministic fake LM: output token at ``position`` is a pure function of
    (input_ids, position) via blake2b. With probability ``eos_rate`` per position (also a pure
    function) the token is ``EOS_ID``; otherwise never EOS.

    ``vocab``: "byte" (default) draws only printable-ASCII byte tokens (ids 35..129 = bytes
    0x20..0x7e, see kvgate.sim.tokenizer), so the output text decodes to exactly one byte per
    token and re-encodes to the same ids: a client that sends "previous prompt + output text +
    observation" as text hits the radix cache exactly like one sending input_ids would (a real
    BPE tokenizer round-trips its own output almost always). "wide" draws ids mod ``VOCAB_SIZE``
    (rendered as " word" strings that do not re-tokenize to the same ids)."""

    def __init__(self, eos_rate: float = 0.0, vocab: str = "byte"):
        if vocab not in ("byte", "wide"):
            raise ValueError(f"vocab must be 'byte' or 'wide', got {vocab!r}")
        self.eos_rate = float(eos_rate)
        self.vocab = vocab
        self._eos_threshold = int(self.eos_rate * (1 << 32))

    @staticmethod
    def seed(input_ids: Sequence[int], sample_key: Optional[int] = None) -> bytes:
        """16-byte digest of the prompt token ids (computed once per request) and, for a sampled
        request (temperature > 0), of its ``sample_key`` (the sampling_seed): greedy decoding is a
        function of the prompt alone, sampling also of the seed (SGLang srt/layers/sampler.py:
        ``sampling_seed`` seeds the per-request multinomial draw; without one the draw comes from the
        engine's generator state)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(len(input_ids).to_bytes(4, "little"))
        try:
            h.update(array("q", input_ids).tobytes())
        except (OverflowError, TypeError):
            h.update(repr(tuple(input_ids)).encode())
        if sample_key is not None:
            h.update(b"sample" + (int(sample_key) & ((1 << 128) - 1)).to_bytes(16, "little"))
        return h.digest()

    def token(self, seed: bytes, position: int) -> int:
        """Output token id at output ``position`` (0-based) for the prompt with ``seed``."""
        d = hashlib.blake2b(seed + position.to_bytes(4, "little"), digest_size=8).digest()
        v = int.from_bytes(d, "little")
        if (v >> 32) < self._eos_threshold:
            return EOS_ID
        if self.vocab == "byte":
            return PRINTABLE_FIRST_ID + (v & 0xFFFFFFFF) % PRINTABLE_COUNT
        tok = (v & 0xFFFFFFFF) % VOCAB_SIZE
        return EOS_ID + 1 if tok == EOS_ID else tok

    def generate(self, input_ids: Sequence[int], n: int, ignore_eos: bool = True,
                 sample_key: Optional[int] = None) -> list[int]:
        """Reference output (what the scheduler must produce) for ``n`` max new tokens; a greedy
        request with ``sample_key=None``, a sampled one with its sampling_seed."""
        s = self.seed(input_ids, sample_key)
        out = []
        for p in range(n):
            t = self.token(s, p)
            out.append(t)
            if t == EOS_ID and not ignore_eos:
                break
        return out


@dataclass
class SchedulerConfig:
    """Scheduler knobs (tokens / seconds). Defaults follow SGLang server_args on an 80 GB GPU."""

    max_running_requests: int = 1024
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 8192
    schedule_conservativeness: float = 1.0
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    decode_base_ms: float = DEFAULT_DECODE_BASE_MS
    decode_per_seq_ms: float = DEFAULT_DECODE_PER_SEQ_MS
    decode_per_ctx_token_us: float = DEFAULT_DECODE_PER_CTX_TOKEN_US
    speed: float = 1.0
    eos_rate: float = 0.0
    token_vocab: str = "byte"     # TokenModel vocab: "byte" (text round-trips) | "wide"
    # --enable-priority-scheduling: the waiting queue sorted by (priority desc, queue entry)
    enable_priority_scheduling: bool = False
    # "0.5.17": new_token_ratio discounts every running request's reservation; "0.5.23": ignore_eos ones
    # reserve at ratio 1.0 (schedule_policy.py _get_running_request_total_token_offset)
    new_token_ratio_semantics: str = "0.5.17"
    # --random-seed: draws the sampling key of sampled requests without a sampling_seed (None: random)
    random_seed: Optional[int] = None
    # attention share of prefill time: FLOPs per extended token per attended context token
    # (4 x layers x q_heads x head_dim) and the weight FLOPs per token (2 x params); 0 = context-free
    prefill_attn_flops_per_ctx_token: float = 0.0
    prefill_weight_flops_per_token: float = 0.0
    # the weights are read at least once per forward pass: minimum time of any batch (ms)
    forward_min_ms: float = 0.0
    # True: a prefill's attention covers each request's whole context, cached prefix included, (prefix +
    # extend)^2 / 2 query-key pairs instead of extend x (prefix + extend / 2): SGLang's torch_native backend (the
    # CPU engine) pads the query to the whole context (srt/layers/attention/torch_native_backend.py
    # _run_sdpa_forward_extend, per_req_query_redudant of seq_len_kv rows)
    prefill_attention_whole_context: bool = False
    # fixed time of every prefill batch on top of its tokens (ms): the CPU engine's per-forward overhead
    prefill_base_ms: float = 0.0
    # every compute time (prefill and decode, not HiCache copies) x this: a host this many times slower than
    # the one the profile was measured on (a shared CPU machine's load changes by the hour)
    compute_scale: float = 1.0
    # HiCache load-back: KV bytes per token of the model and the host-to-device bandwidth (bytes/s)
    kv_bytes_per_token: int = 131072
    hicache_h2d_bytes_per_s: float = DEFAULT_H2D_BYTES_PER_S


@dataclass(eq=False)
class Request:
    """One generate request. ``input_ids`` tokens; ``max_new_tokens`` default 128 as SGLang."""

    rid: str
    input_ids: tuple
    max_new_tokens: int = 128
    ignore_eos: bool = False
    session_id: Optional[str] = None
    priority: int = 0
    temperature: float = 0.0      # 0 = greedy (the core's default; the HTTP layer uses SGLang's 1.0)
    sampling_seed: Optional[int] = None
    # --- state (managed by the scheduler)
    output_ids: list = field(default_factory=list)
    state: str = "new"           # new|waiting|prefill|running|finished
    kv_len: int = 0              # tokens of KV held (prefix + private)
    prefix_len: int = 0          # locked cached prefix at the last admission
    private: int = 0             # privately allocated pool tokens
    last_node: Optional[TreeNode] = None
    fill_len: int = 0            # prompt length of the current (re)prefill
    num_retractions: int = 0
    cached_tokens: int = 0
    finish_reason: Optional[dict] = None
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    seq: int = 0
    queue_seq: int = 0           # waiting-queue entry order (re-stamped on retraction)
    loading: int = 0             # tokens loaded back from the host tier in the current prefill
    session_generation: Optional[int] = None
    # PD decode: the prompt's KV arrived from a prefill worker (the transfer time was paid before submit), so
    # its extend allocates KV and fills the radix cache without prefill compute
    kv_transferred: bool = False
    _seed: Optional[bytes] = None

    def __post_init__(self):
        self.input_ids = tuple(int(t) for t in self.input_ids)

    @property
    def remaining_new(self) -> int:
        """Tokens still to generate."""
        return max(self.max_new_tokens - len(self.output_ids), 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Event:
    """Output of the core: ``new_ids`` generated for ``req`` this step; ``finished`` when done."""

    req: Request
    new_ids: list
    finished: bool


@dataclass
class Batch:
    """A scheduled forward batch. ``kind`` is "prefill" (items = (req, extend tokens)) or
    "decode" (items = (req, 1)); ``duration_s`` is simulated GPU time already divided by speed."""

    kind: str
    items: list
    duration_s: float
    steps: int = 1


class Scheduler:
    """SGLang-like scheduler of one (dp) rank over a :class:`RadixCache`.

    ``clock()`` returns seconds and is only used to stamp arrival/first-token/finish times.
    """

    def __init__(self, cache: RadixCache, config: Optional[SchedulerConfig] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cache = cache
        self.cfg = config or SchedulerConfig()
        if self.cfg.new_token_ratio_semantics not in NEW_TOKEN_RATIO_SEMANTICS:
            raise ValueError(f"new_token_ratio_semantics must be one of {NEW_TOKEN_RATIO_SEMANTICS}")
        self.clock = clock
        self.model = TokenModel(self.cfg.eos_rate, self.cfg.token_vocab)
        self._rng = random.Random(self.cfg.random_seed)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.chunked: Optional[Request] = None
        self.requests: dict[str, Request] = {}
        self._events: list[Event] = []
        self._seq = 0
        self._queue_seq = 0
        self.batch_is_full = False
        self.init_new_token_ratio = min(0.7 * self.cfg.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) \
            / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio
        # counters (monotonic)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self.num_requests_total = 0
        self.aborted_total = 0
        self.retracted_total = 0
        self.last_retracted = 0
        self.decode_steps = 0
        self.prefill_batches = 0
        self.admitted_input_tokens = 0
        self.admitted_cached_tokens = 0
        self.clipped_total = 0
        self.host_hit_tokens = 0      # prompt tokens loaded back from the host tier (not recomputed)
        self.load_back_tokens = 0
        self.load_back_seconds = 0.0
        self.sessions_seen: dict[str, int] = {}

    # ------------------------------------------------------------------ inputs
    def add_request(self, req: Request) -> None:
        """Queue ``req`` (fcfs). Raises ValueError for an empty prompt, a prompt that cannot fit
        the pool (len >= max_total) or a duplicate rid.

        ``max_new_tokens`` is clipped on arrival to what an empty pool can hold:
        ``min(max_new, max_total - prompt - 2)`` (scheduler.py init_req_max_new_tokens: max_req_len -
        input_len - 1 with max_req_len = max_total - 1, and allocator/base.py max_new_tokens_for_memory:
        capacity - input - page_size - 1), so such a request ends with finish_reason length instead of
        running alone into an out-of-memory abort. A request with a session_id takes its session's
        current generation, re-opening a closed id (session_ref_tracker.py ensure_session_generation)."""
        if not req.input_ids:
            raise ValueError("The input_ids is empty.")
        if len(req.input_ids) >= self.cache.max_total:
            raise ValueError(
                f"The input ({len(req.input_ids)} tokens) is longer than the KV pool "
                f"({self.cache.max_total} tokens).")
        if req.rid in self.requests:
            raise ValueError(f"Duplicate request id {req.rid}")
        if req.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        cap = max(0, self.cache.max_total - len(req.input_ids) - 2)
        if req.max_new_tokens > cap:
            req.max_new_tokens = cap
            self.clipped_total += 1
        self._seq += 1
        req.seq = self._seq
        req.arrival_time = self.clock()
        req.state = "waiting"
        key = None
        if req.temperature > 0:
            key = req.sampling_seed if req.sampling_seed is not None else self._rng.getrandbits(64)
        req._seed = self.model.seed(req.input_ids, key)
        self.requests[req.rid] = req
        if req.session_id:
            self.sessions_seen[req.session_id] = self.sessions_seen.get(req.session_id, 0) + 1
            req.session_generation = self.cache.ensure_session_generation(req.session_id)
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        """Append to the BACK of the waiting queue (scheduler.py _add_request_to_queue; retracted
        requests too), stamping the queue-entry order the priority sort breaks ties with."""
        self._queue_seq += 1
        req.queue_seq = self._queue_seq
        self.waiting.append(req)

    def _order_waiting(self) -> None:
        """schedule_policy.py calc_priority: with fcfs the queue stays in entry order; with
        --enable-priority-scheduling it is sorted by (priority, queue entry time), higher priority
        first (_sort_by_priority_and_fcfs, schedule_low_priority_values_first off)."""
        if self.cfg.enable_priority_scheduling and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=lambda r: (-r.priority, r.queue_seq)))

    def abort(self, rid: str, message: str = "Abort request") -> bool:
        """Abort ``rid`` wherever it is (not while a batch containing it is in flight: call
        between commit and schedule). A running request's KV is released through
        cache_finished_req (becomes evictable) as SGLang does. Returns False if unknown."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        if req.state == "waiting":
            self.waiting.remove(req)
        elif req.state in ("running", "prefill"):
            if req in self.running:
                self.running.remove(req)
                self.batch_is_full = False
            if self.chunked is req:
                self.chunked = None
            self._release(req, cache=True, tag=False)
        self._finish(req, {"type": "abort", "message": message}, aborted=True)
        return True

    def abort_all(self) -> int:
        """Abort every queued and running request; returns how many."""
        rids = [r.rid for r in list(self.waiting) + self.running
                + ([self.chunked] if self.chunked else [])]
        return sum(self.abort(rid) for rid in dict.fromkeys(rids))

    def pop_events(self) -> list[Event]:
        """Take the events produced since the last call."""
        ev, self._events = self._events, []
        return ev

    def is_idle(self) -> bool:
        return not self.waiting and not self.running and self.chunked is None

    # ------------------------------------------------------------------ helpers
    def _fill_ids(self, req: Request) -> tuple:
        return req.input_ids + tuple(req.output_ids)

    def _running_ratio(self, r: Request) -> float:
        if r.ignore_eos and self.cfg.new_token_ratio_semantics == "0.5.23":
            return 1.0
        return self.new_token_ratio

    def _reserved(self, batch: list[tuple[Request, int]]) -> float:
        """Tokens reserved for future decode of running/chunked/in-batch requests: a running
        request reserves min(max_new - generated, 4096) x new_token_ratio (0.5.17
        schedule_policy.py _get_running_request_total_token_offset; 0.5.23 uses 1.0 for ignore_eos),
        a request of the batch being formed reserves its full min(max_new, 4096)."""
        total = 0.0
        for r in self.running:
            total += min(r.remaining_new, CLIP_MAX_NEW_TOKENS) * self._running_ratio(r)
        for r, _ in batch:
            total += min(r.remaining_new, CLIP_MAX_NEW_TOKENS)
        if self.chunked is not None and all(r is not self.chunked for r, _ in batch):
            total += self.chunked.fill_len - self.chunked.kv_len
            total += min(self.chunked.remaining_new, CLIP_MAX_NEW_TOKENS)
        return total

    def admission_budget(self, batch: Optional[list] = None) -> float:
        """PrefillAdder rem_total_tokens: available + evictable - reserved decode tokens."""
        return self.cache.available + self.cache.evictable - self._reserved(batch or [])

    def _release(self, req: Request, cache: bool, tag: bool = True) -> None:
        """Give back req's KV: insert into the radix tree (cache=True, cache_finished_req; session
        refs only with ``tag``: not for aborted requests) or free only its private tokens (the
        retraction path: the prompt inserted at prefill end stays cached, just unlocked)."""
        if cache and req.kv_len > 0:
            ids = self._fill_ids(req)[:req.kv_len]
            self.cache.insert(ids, session_id=req.session_id, priority=req.priority,
                              n_private=req.private, generation=req.session_generation, tag=tag)
        else:
            self.cache.free(req.private)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.last_node = None
        req.private = 0
        req.kv_len = 0

    def _cache_unfinished(self, req: Request) -> None:
        """cache_unfinished_req after a prefill (or a prefill chunk): the KV written so far goes into
        the radix tree and the request's lock moves to its new last node, so a running request's prompt
        is shareable at once and a retraction frees only what was generated after it
        (batch_result_processor.py maybe_cache_unfinished_req; scheduler.py for chunks)."""
        ids = self._fill_ids(req)[:req.kv_len]
        self.cache.insert(ids, priority=req.priority, n_private=req.private, tag=False,
                          chunked=req.kv_len < req.fill_len)
        m = self.cache.match_prefix(ids)
        self.cache.lock(m.node)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.last_node = m.node
        req.private = 0

    def _finish(self, req: Request, reason: dict, aborted: bool = False,
                new_ids: Optional[list] = None) -> None:
        req.finish_reason = reason
        req.state = "finished"
        req.finish_time = self.clock()
        self.requests.pop(req.rid, None)
        self.num_requests_total += 1
        self.prompt_tokens_total += len(req.input_ids)
        self.generation_tokens_total += len(req.output_ids)
        self.cached_tokens_total += req.cached_tokens
        if aborted:
            self.aborted_total += 1
        self._events.append(Event(req, new_ids or [], True))

    def _emit_token(self, req: Request) -> None:
        tok = self.model.token(req._seed, len(req.output_ids))
        req.output_ids.append(tok)
        if req.first_token_time is None:
            req.first_token_time = self.clock()
        if len(req.output_ids) >= req.max_new_tokens:
            reason = {"type": "length", "length": len(req.output_ids)}
        elif tok == EOS_ID and not req.ignore_eos:
            reason = {"type": "stop", "matched": EOS_ID}
        else:
            self._events.append(Event(req, [tok], False))
            return
        self.running.remove(req)
        self.batch_is_full = False   # a running request left (scheduler.py filter_batch)
        self._release(req, cache=True)
        self._finish(req, reason, new_ids=[tok])

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> Optional[Batch]:
        """get_next_batch_to_run: form a prefill batch if any request can be admitted, else a
        decode batch of all running requests (retracting / OOM-aborting as needed). Allocates
        the batch's KV now. Returns None when idle."""
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> Optional[Batch]:
        """get_new_batch_prefill + PrefillAdder. Rules (SGLang 0.5.17/0.5.23 scheduler.py):

        * batch_is_full latches when a round stops for lack of tokens (add_one_req NO_TOKEN) or of
          request slots while something runs or was admitted; no prefill is tried again until a running
          request leaves (finish, retraction, abort) or nothing runs.
        * every request's prefix is matched and locked first and the batch's extend KV is allocated
          once the batch is formed (prepare_for_extend), so admitting one request cannot evict the
          prefix a later request of the same batch matched.
        """
        if self.batch_is_full and not self.running:
            self.batch_is_full = False
        if not self.waiting and self.chunked is None:
            return None
        if self.batch_is_full and self.chunked is None:
            return None
        cfg = self.cfg
        items: list[tuple[Request, int]] = []
        rem_input = cfg.max_prefill_tokens
        rem_chunk = cfg.chunked_prefill_size
        cache = self.cache
        if self.chunked is not None:
            r = self.chunked
            take = min(r.fill_len - r.kv_len, rem_chunk)
            cache.alloc(take)
            r.private += take
            r.kv_len += take
            items.append((r, take))
            rem_chunk -= take
            rem_input -= take
            if r.kv_len < r.fill_len:
                return self._prefill_batch(items)
            self.chunked = None
        self._order_waiting()
        pending = 0          # extend tokens of this batch not yet allocated
        new: list[tuple[Request, int]] = []
        while self.waiting:
            if len(self.running) + len(items) >= cfg.max_running_requests:
                self.batch_is_full = True
                break
            if rem_chunk <= 0 or rem_input <= 0:
                break
            r = self.waiting[0]
            fill = self._fill_ids(r)
            m = cache.match_prefix(fill[:len(fill) - 1])
            # HiCache: a device miss that hits the host tier is loaded back (device KV allocated like an
            # extend, no prefill compute); schedule_policy.py add_one_req counts host_hit_length in the
            # request's tokens, init_load_back allocates them (hiradix_cache.py)
            load = max(0, cache.host_match(fill[:len(fill) - 1]) - m.length)
            extend = len(fill) - m.length - load
            need = extend + load + min(r.remaining_new, CLIP_MAX_NEW_TOKENS)
            cache.lock(m.node)
            budget = self.admission_budget(items) - pending
            lone = not items and not self.running and self.chunked is None
            ok = need <= budget or (lone and extend + load <= cache.available + cache.evictable)
            if not ok or (extend > rem_input and items):
                cache.unlock(m.node)
                if not ok and (items or self.running):
                    self.batch_is_full = True
                break
            take = min(extend, rem_chunk)
            pending += take + load
            self.waiting.popleft()
            r.state = "prefill"
            r.last_node = m.node
            r.prefix_len = m.length
            r.fill_len = len(fill)
            r.kv_len = m.length + load + take
            r.private = load + take
            r.loading = load
            r.cached_tokens += m.length + load
            self.host_hit_tokens += load
            self.admitted_cached_tokens += m.length + load
            self.admitted_input_tokens += len(fill)
            items.append((r, take))
            new.append((r, take))
            rem_chunk -= take
            rem_input -= take
            if take < extend:
                self.chunked = r
                break
        if pending:
            cache.alloc(pending)   # every prefix is locked: evicts only unlocked entries
        if not items:
            return None
        return self._prefill_batch(items)

    def prefill_time_s(self, items) -> float:
        """Simulated time of a prefill batch of ``(request, extend tokens)`` (seconds, at speed 1
        before dividing by ``speed``).

        Without the attention constants: extend tokens / prefill_tokens_per_s. With them, the weight
        FLOPs (2 x params per token) cost exactly that, and attention adds per extended token
        4 x layers x q_heads x head_dim x (cached prefix + extend / 2) FLOPs at the same throughput
        (causal attention over the prefix and half the new tokens); a re-prefilled long agent context
        costs +60% for a 32B model at 30k tokens. Any forward pass takes at least ``forward_min_ms``
        (the weights are read from HBM once per pass). Requests whose KV a prefill worker sent (PD decode,
        ``kv_transferred``) cost nothing here; a batch of only those takes no time."""
        cfg = self.cfg
        items = [(r, t) for r, t in items if not r.kv_transferred]
        if not items:
            return 0.0
        tokens = sum(t for _, t in items)
        dur = tokens / cfg.prefill_tokens_per_s
        if tokens and cfg.prefill_attn_flops_per_ctx_token > 0 and cfg.prefill_weight_flops_per_token > 0:
            attn = 0.0
            for r, t in items:
                prefix = r.kv_len - t
                pairs = r.kv_len * r.kv_len / 2.0 if cfg.prefill_attention_whole_context else t * (prefix + t / 2.0)
                attn += pairs * cfg.prefill_attn_flops_per_ctx_token
            dur *= 1.0 + attn / (tokens * cfg.prefill_weight_flops_per_token)
        if tokens:
            dur += cfg.prefill_base_ms * 1e-3
        dur *= cfg.compute_scale
        load = sum(r.loading for r, _ in items)
        if load:
            # layer-wise load-back overlaps the forward (cache_controller.py LayerDoneCounter: layer i
            # computes once its KV arrived), so the batch takes the longer of the two
            dur = max(dur, load * cfg.kv_bytes_per_token / cfg.hicache_h2d_bytes_per_s)
        return max(dur, cfg.forward_min_ms * 1e-3)

    def _prefill_batch(self, items) -> Batch:
        load = sum(r.loading for r, _ in items)
        if load:
            self.load_back_tokens += load
            self.load_back_seconds += load * self.cfg.kv_bytes_per_token / self.cfg.hicache_h2d_bytes_per_s
        return Batch("prefill", items, self.prefill_time_s(items) / self.cfg.speed)

    def _schedule_decode(self) -> Optional[Batch]:
        if not self.running:
            self.new_token_ratio = self.init_new_token_ratio
            return None
        cache = self.cache
        if not cache.can_alloc(len(self.running)):
            # update_running_batch: after a retraction the ratio is set, not decayed
            self._retract()
            if not self.running:
                return None
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay,
                                       self.min_new_token_ratio)
        cache.alloc(len(self.running))
        for r in self.running:
            r.private += 1
            r.kv_len += 1
        cfg = self.cfg
        ctx = sum(r.kv_len for r in self.running)
        dur = (cfg.decode_base_ms * 1e-3 + cfg.decode_per_seq_ms * 1e-3 * len(self.running)
               + cfg.decode_per_ctx_token_us * 1e-6 * ctx) * cfg.compute_scale
        return Batch("decode", [(r, 1) for r in self.running],
                     max(dur, cfg.forward_min_ms * 1e-3) / cfg.speed)

    def _retract(self) -> None:
        """retract_decode (schedule_batch.py): pop requests with the fewest output tokens (ties:
        longest input) until one decode step fits; a lone request that still does not fit is aborted.

        release_req frees only the request's own KV past its protected prefix (the prompt was inserted
        at prefill end, mem_cache/common.py release_kv_cache), so the prompt stays cached, unlocked;
        then evicts until ``remaining requests x SGLANG_RETRACT_DECODE_STEPS (20)`` slots are free
        (evict_from_tree_cache). Retracted requests go to the BACK of the waiting queue in retraction
        order (scheduler.py update_running_batch -> _add_request_to_queue)."""
        order = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)),
                       reverse=True)
        retracted: list[Request] = []
        while not self.cache.can_alloc(len(order)):
            if len(order) == 1:
                r = order.pop()
                self.running.remove(r)
                self._release(r, cache=False)
                self._finish(r, {"type": "abort", "message": OOM_MESSAGE,
                                 "status_code": 500}, aborted=True)
                break
            r = order.pop()
            self.running.remove(r)
            self._release(r, cache=False)
            want = len(order) * RETRACT_DECODE_STEPS
            if self.cache.available < want:
                self.cache.evict(want - self.cache.available)
            r.num_retractions += 1
            r.state = "waiting"
            retracted.append(r)
        self.batch_is_full = False
        if retracted:
            for r in retracted:
                self._enqueue(r)
            self.retracted_total += len(retracted)
            self.last_retracted = len(retracted)
            if order:
                decoded = sum(len(r.output_ids) for r in order)
                max_new = sum(r.max_new_tokens for r in order)
                est = (decoded + RETRACT_DECODE_STEPS * len(order)) / max(max_new, 1)
                self.new_token_ratio = min(1.0, est)

    # ------------------------------------------------------------------ commit
    def commit(self, batch: Batch) -> None:
        """Run the batch's model outputs: prefill completes prompts (first token), decode
        appends one token per request; finished requests are cached (cache_finished_req)."""
        if batch.kind == "prefill":
            self.prefill_batches += 1
            for r, _ in batch.items:
                r.loading = 0
                if r.finished:
                    continue
                self._cache_unfinished(r)
                if r.kv_len < r.fill_len:
                    continue
                r.state = "running"
                self.running.append(r)
                if r.remaining_new == 0:
                    self.running.remove(r)
                    self._release(r, cache=True)
                    self._finish(r, {"type": "length", "length": len(r.output_ids)})
                    continue
                self._emit_token(r)
        else:
            self.decode_steps += 1
            for r, _ in batch.items:
                if r.finished or r.state != "running":
                    continue
                self._emit_token(r)

    def step(self) -> Optional[Batch]:
        """schedule() + commit(); returns the batch (None when idle)."""
        b = self.schedule()
        if b is not None:
            self.commit(b)
        return b

    def run_until_idle(self, advance: Optional[Callable[[float], None]] = None,
                       max_steps: int = 1_000_000) -> float:
        """Drive to idle; ``advance(duration_s)`` moves a fake clock. Returns simulated seconds."""
        total = 0.0
        for _ in range(max_steps):
            b = self.schedule()
            if b is None:
                return total
            if advance is not None:
                advance(b.duration_s)
            total += b.duration_s
            self.commit(b)
        raise RuntimeError("scheduler did not become idle")

    # ------------------------------------------------------------------ observability
    def cache_hit_rate(self) -> float:
        """Cached / admitted prompt tokens (cumulative)."""
        if not self.admitted_input_tokens:
            return 0.0
        return self.admitted_cached_tokens / self.admitted_input_tokens

    def num_queue(self) -> int:
        return len(self.waiting) + (1 if self.chunked is not None else 0)
