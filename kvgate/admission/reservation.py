"""Reservation estimate: how many KV tokens a request may occupy (pure, no I/O except the optional loader).

Rule (Relax's ledger): reservation = prompt tokens + completion budget, the completion part bounded
by min(max_new_tokens, expected_decode_cap). Where the budget is not given:
- /generate: SGLang's default of 128 new tokens (srt/managers/io_struct.py, srt/sampling/sampling_params.py);
- the OpenAI routes (completions, chat, responses): SGLang lets the call run to the context length, so the
  budget is min(context_length - prompt, expected_decode_cap) (expected_decode_cap when the context length
  is not known).
Batch items reserve for every item; ``n`` > 1 copies of one prompt share it (SGLang prefills the prompt
once and the copies reuse its radix-cache prefix), so they reserve the prompt once and n completions.
:func:`estimate_request` also returns the prompt's leading block hashes, so the ledger can count a
prefix that other live requests already hold once (kvgate.admission.working_set).
"""

from __future__ import annotations

import functools

import math
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable

from kvgate.common import prefix_hash

from .working_set import DEFAULT_BLOCK_TOKENS

__all__ = [
    "SGLANG_DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_CHARS_PER_TOKEN",
    "CHAT_MESSAGE_OVERHEAD_TOKENS",
    "MIN_PROMPT_TOKENS",
    "TokenCounter",
    "Reservation",
    "Estimator",
    "estimate_request",
    "estimate_reservation",
    "estimate_text_tokens",
    "prefix_blocks",
    "load_tokenizer_counter",
]

#: SGLang's default for sampling_params.max_new_tokens (srt/managers/io_struct.py, srt/sampling/sampling_params.py).
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128

#: Characters per token for the fallback estimate. English BPE vocabularies (Llama 3, Qwen 2/3, GPT-4 class)
#: average ~4 characters per token on prose and ~3-3.5 on code/JSON; dividing by 3.0 therefore over-estimates
#: the prompt by ~25% on prose. Over-reserving is the safe side for admission: it only holds work a little
#: earlier, while under-reserving lets the engines evict. CJK text (~1-1.5 chars/token) is under-estimated;
#: configure a tokenizer file for such workloads.
DEFAULT_CHARS_PER_TOKEN = 3.0

#: Chat-template tokens per message (role markers, separators); Llama 3 / Qwen templates use ~4-6.
CHAT_MESSAGE_OVERHEAD_TOKENS = 8

#: Prompt tokens assumed when the prompt cannot be read (odd body): the documented minimum is this plus the
#: completion budget, so every request reserves at least 1 + min(128, expected_decode_cap) tokens per sequence.
MIN_PROMPT_TOKENS = 1

#: A tokenizer callable: text -> number of tokens.
TokenCounter = Callable[[str], int]


@functools.lru_cache(maxsize=4)
def load_tokenizer_counter(path: str) -> TokenCounter:
    """Load a Hugging Face ``tokenizer.json`` file and return a text -> token-count callable.

    This is the only I/O in the admission core and happens once at startup (kept per path: validating the
    config loads it, and the gate takes the same counter). Raises ImportError if the
    ``tokenizers`` package is not installed, and whatever ``tokenizers.Tokenizer.from_file`` raises for a bad
    file. Special tokens are not added (the chat template overhead is added separately).
    """
    try:
        from tokenizers import Tokenizer  # type: ignore[import-not-found]
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("a tokenizer file needs the 'tokenizers' package (pip install tokenizers)") from e
    tok = Tokenizer.from_file(path)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    return count


def estimate_text_tokens(text: str, *, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN, tokenizer: TokenCounter | None = None) -> int:
    """Tokens in ``text``: ``tokenizer(text)`` if given (falls back on error), else ceil(len / chars_per_token)."""
    if not text:
        return 0
    if tokenizer is not None:
        try:
            n = int(tokenizer(text))
            if n >= 0:
                return n
        except Exception:
            pass
    return int(math.ceil(len(text) / chars_per_token))


def _int_or_none(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if v >= 0 else None
    if isinstance(v, float) and math.isfinite(v) and v >= 0:
        return int(math.ceil(v))
    return None


def _n_or_one(v: Any) -> int:
    n = _int_or_none(v)
    return n if n is not None and n >= 1 else 1


def _completion(max_new: Any, cap: int) -> int:
    m = _int_or_none(max_new)
    if m is None:
        m = SGLANG_DEFAULT_MAX_NEW_TOKENS
    return min(m, cap)


def _is_token_id(x: Any) -> bool:
    return type(x) is int  # bool is an int subclass but not a token id


def _is_int_list(v: Any) -> bool:
    """A non-empty list of token ids, judged by its first and last items only: a 64K-token prompt is counted
    with len() at C speed instead of type-checking every id in Python. A list mixing ids and other values is
    rejected by SGLang itself (400); counting its length then only reserves for a request that fails at once."""
    return isinstance(v, list) and bool(v) and _is_token_id(v[0]) and _is_token_id(v[-1])


def _content_chars(content: Any) -> str:
    """Text of a chat/responses content field: string, or list of parts with "text" (text / input_text...)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping):
                t = part.get("text")
                if isinstance(t, str):
                    out.append(t)
        return "".join(out)
    return ""


def _messages_tokens(messages: Any, est: Callable[[str], int]) -> int | None:
    if not isinstance(messages, list):
        return None
    total = 0
    for m in messages:
        if isinstance(m, str):  # responses API allows bare strings in lists
            total += est(m) + CHAT_MESSAGE_OVERHEAD_TOKENS
            continue
        if not isinstance(m, Mapping):
            continue
        text = _content_chars(m.get("content"))
        # assistant tool calls and responses-API function_call items carry text too
        for tc in m.get("tool_calls") or ():
            if isinstance(tc, Mapping) and isinstance(tc.get("function"), Mapping):
                f = tc["function"]
                text += str(f.get("name") or "") + str(f.get("arguments") or "")
        for key in ("arguments", "output", "name"):
            v = m.get(key)
            if isinstance(v, str) and m.get("type") in ("function_call", "function_call_output"):
                text += v
        total += est(text) + CHAT_MESSAGE_OVERHEAD_TOKENS
    return total


def _json_text(v: Any) -> str:
    try:
        import orjson

        return orjson.dumps(v).decode()
    except Exception:
        return repr(v)


def _prompts_generate(body: Mapping[str, Any], est: Callable[[str], int]) -> list[int] | None:
    """Prompt token counts per batch item for /generate (input_ids, text or input_embeds)."""
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids:
        if _is_int_list(ids):
            return [len(ids)]
        if all(isinstance(x, list) for x in ids):
            return [len(x) for x in ids]
    text = body.get("text")
    if isinstance(text, str):
        return [est(text)]
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return [est(t) for t in text]
    emb = body.get("input_embeds")
    if isinstance(emb, list) and emb:
        # single: [seq][hidden] floats; batch: [batch][seq][hidden]
        if isinstance(emb[0], list) and emb[0] and isinstance(emb[0][0], list):
            return [len(x) if isinstance(x, list) else 0 for x in emb]
        return [len(emb)]
    return None


def _prompts_completions(prompt: Any, est: Callable[[str], int]) -> list[int] | None:
    if isinstance(prompt, str):
        return [est(prompt)]
    if isinstance(prompt, list) and prompt:
        if _is_int_list(prompt):
            return [len(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [est(p) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            return [len(p) for p in prompt]
    return None


@dataclass(slots=True)
class Reservation:
    """What one request may occupy, in KV tokens.

    tokens: the reservation (prompt tokens once per distinct prompt + a completion budget per sequence), >= 1;
    prompt_tokens: the prompt part of it; sequences: batch items x n;
    blocks: hashes of the prompt's leading whole blocks of ``block_tokens`` tokens (chained: equal hashes mean
    equal prefixes), empty for batches and unreadable prompts; always len(blocks) x block_tokens <= prompt_tokens.
    """

    tokens: int
    prompt_tokens: int = 0
    sequences: int = 1
    blocks: tuple[int, ...] = ()
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    @property
    def tail(self) -> int:
        """Tokens beyond the prefix blocks (the rest of the prompt and the completion budget)."""
        return max(0, self.tokens - len(self.blocks) * self.block_tokens)


def prefix_blocks(key: list[int] | str | None, block_tokens: int, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
                  max_blocks: int | None = None, memo: prefix_hash.BlockDigests | None = None) -> tuple[int, ...]:
    """Chained hashes of the whole leading blocks of a prompt.

    ``key``: token ids (a block is ``block_tokens`` ids) or text (a block is round(block_tokens x
    chars_per_token) characters, the same rate the token estimate uses). At most ``max_blocks`` blocks.
    One C hash per block (kvgate.common.prefix_hash.chain): a 64K-token prompt is 1,024 steps. In-process
    keys (text uses Python's randomised str hash): they are never stored or sent anywhere. ``memo``: the
    request's block hashes (prefix_hash.BlockDigests), shared with placement's prefix keys.
    """
    if not key or block_tokens <= 0:
        return ()
    text = isinstance(key, str)
    step = block_tokens if not text else max(1, int(round(block_tokens * chars_per_token)))
    n = len(key) // step
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n <= 0:
        return ()
    try:
        return tuple(prefix_hash.chain(key, step, _BLOCK_SEED[text], 0, n, memo)[1:])
    except TypeError:  # an unhashable item in an odd prompt: no blocks, the reservation stands as is
        return ()


#: Chain start per kind of prompt: token ids never share keys with text.
_BLOCK_SEED = {False: 0x6B76_6761_7465_0010, True: 0x6B76_6761_7465_0011}


def estimate_reservation(
    path: str,
    body: Any,
    *,
    expected_decode_cap: int,
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
    tokenizer: TokenCounter | None = None,
    context_length: int | None = None,
) -> int:
    """KV tokens to reserve for one request (``estimate_request(...).tokens``); see :func:`estimate_request`."""
    return estimate_request(path, body, expected_decode_cap=expected_decode_cap, chars_per_token=chars_per_token,
                            tokenizer=tokenizer, context_length=context_length, block_tokens=0).tokens


def estimate_request(
    path: str,
    body: Any,
    *,
    expected_decode_cap: int,
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
    tokenizer: TokenCounter | None = None,
    context_length: int | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    memo: prefix_hash.BlockDigests | None = None,
) -> Reservation:
    """The :class:`Reservation` of one request.

    Takes the request ``path`` (/generate, /v1/completions, /v1/chat/completions, /v1/responses; query
    string and trailing slash ignored) and its parsed JSON ``body``. Completion budget per sequence =
    min(max_new_tokens, expected_decode_cap) where max_new_tokens is ``sampling_params.max_new_tokens``
    (/generate; per-item when sampling_params is a list), ``max_completion_tokens`` or ``max_tokens``
    (OpenAI completions/chat) or ``max_output_tokens`` (responses). Not given: 128 on /generate (SGLang's
    default), min(context_length - prompt, expected_decode_cap) on the OpenAI routes (SGLang runs them to the
    context length; ``context_length`` None = unknown = expected_decode_cap). Sequences: batch items x n
    (``sampling_params.n`` for /generate, ``n`` for OpenAI); the n copies of one prompt reserve it once.
    Prompt tokens: len(input_ids) / token-id prompts exactly; text, chat messages (plus
    CHAT_MESSAGE_OVERHEAD_TOKENS per message, plus ``tools`` JSON) and responses ``input``/``instructions``
    estimated with ``tokenizer`` if given else ceil(chars / chars_per_token). ``block_tokens`` 0 = no blocks.
    Never raises on odd bodies: an unreadable prompt counts MIN_PROMPT_TOKENS. Raises ValueError only for a
    bad configuration (expected_decode_cap <= 0 or chars_per_token <= 0).
    """
    return Estimator(expected_decode_cap=expected_decode_cap, chars_per_token=chars_per_token, tokenizer=tokenizer,
                     context_length=context_length, block_tokens=block_tokens)(path, body, memo)


class Estimator:
    """:func:`estimate_request` with its settings checked once: made at start, called per request as
    ``estimator(path, body, memo=None) -> Reservation``. Raises ValueError for a bad setting (see
    estimate_request). A ``/generate`` call with a flat token-id prompt (the RL rollout's usual call) is read
    directly, with the same result as the general rules.
    """

    def __init__(self, *, expected_decode_cap: int, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
                 tokenizer: TokenCounter | None = None, context_length: int | None = None,
                 block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if isinstance(expected_decode_cap, bool) or not isinstance(expected_decode_cap, int) \
                or expected_decode_cap <= 0:
            raise ValueError(f"expected_decode_cap must be a positive int, got {expected_decode_cap!r}")
        if not (isinstance(chars_per_token, (int, float)) and math.isfinite(chars_per_token) and chars_per_token > 0):
            raise ValueError(f"chars_per_token must be > 0, got {chars_per_token!r}")
        self.cap = expected_decode_cap
        self.ctx = context_length if isinstance(context_length, int) and not isinstance(context_length, bool) \
            and context_length > 0 else None
        self.chars_per_token = chars_per_token
        self.block_tokens = block_tokens
        self._default_completion = min(SGLANG_DEFAULT_MAX_NEW_TOKENS, self.cap)

        def est(text: str) -> int:
            return estimate_text_tokens(text, chars_per_token=chars_per_token, tokenizer=tokenizer)

        self._est = est

    def __call__(self, path: str, body: Any, memo: prefix_hash.BlockDigests | None = None) -> Reservation:
        if path == "/generate" and type(body) is dict:
            ids = body.get("input_ids")
            sp = body.get("sampling_params")
            if type(ids) is list and ids and type(ids[0]) is int and type(ids[-1]) is int \
                    and (sp is None or type(sp) is dict):
                prompt = len(ids)
                n, completion = 1, self._default_completion
                if sp:
                    v = sp.get("n")
                    if v is not None:
                        n = _n_or_one(v)
                    v = sp.get("max_new_tokens")
                    if type(v) is int and v >= 0:  # the usual value, read without the general checks
                        completion = v if v < self.cap else self.cap
                    elif v is not None:
                        completion = _completion(v, self.cap)
                try:
                    return self._reservation(prompt + n * completion, prompt, n, ids, memo)
                except Exception:
                    return self._unreadable()
        return self.general(path, body, memo)

    def general(self, path: str, body: Any, memo: prefix_hash.BlockDigests | None = None) -> Reservation:
        """The general rules for any route and body (what __call__ does for the bodies it does not read
        directly)."""
        try:
            total, prompt, seqs, key = _estimate(_norm_path(path), body, self.cap, self.ctx, self._est)
            return self._reservation(total, prompt, seqs, key, memo)
        except Exception:
            return self._unreadable()

    def _unreadable(self) -> Reservation:
        return Reservation(MIN_PROMPT_TOKENS + self._default_completion, MIN_PROMPT_TOKENS)

    def _reservation(self, total: int, prompt: int, seqs: int, key: Any,
                     memo: prefix_hash.BlockDigests | None) -> Reservation:
        bt = self.block_tokens
        # a prompt under one block has none to hash (max_blocks would be 0): no call at all
        blocks = prefix_blocks(key, bt, self.chars_per_token, max_blocks=prompt // bt, memo=memo) \
            if bt > 0 and key and prompt >= bt else ()
        return Reservation(max(1, total), prompt, seqs, blocks, bt or DEFAULT_BLOCK_TOKENS)


def _norm_path(path: Any) -> str:
    p = str(path or "").split("?", 1)[0]
    return p.rstrip("/") or "/"


def _openai_budget(max_new: Any, prompt: int, cap: int, ctx: int | None) -> int:
    m = _int_or_none(max_new)
    if m is not None:
        return min(m, cap)
    return min(max(0, ctx - prompt), cap) if ctx is not None else cap


def _messages_key(messages: Any, tools: Any) -> str | None:
    """The text a prefix hash is taken over for chat/responses input: tools first (templates render them at
    the top), then each message's role and content, in order."""
    parts = [_json_text(tools)] if tools else []
    if isinstance(messages, str):
        parts.append(messages)
    elif isinstance(messages, list):
        for m in messages:
            if isinstance(m, str):
                parts.append("\x00user\x00" + m)
            elif isinstance(m, Mapping):
                text = _content_chars(m.get("content"))
                for tc in m.get("tool_calls") or ():
                    if isinstance(tc, Mapping) and isinstance(tc.get("function"), Mapping):
                        text += str(tc["function"].get("name") or "") + str(tc["function"].get("arguments") or "")
                parts.append("\x00" + str(m.get("role") or m.get("type") or "") + "\x00" + text)
    return "".join(parts) or None


def _estimate(path: str, body: Any, cap: int, ctx: int | None,
              est: Callable[[str], int]) -> tuple[int, int, int, Any]:
    """(reservation tokens, prompt tokens, sequences, prefix key or None)."""
    fallback = (MIN_PROMPT_TOKENS + min(SGLANG_DEFAULT_MAX_NEW_TOKENS, cap), MIN_PROMPT_TOKENS, 1, None)
    if not isinstance(body, Mapping):
        return fallback
    if path.endswith("/generate") or ("sampling_params" in body and "messages" not in body):
        prompts = _prompts_generate(body, est) or [MIN_PROMPT_TOKENS]
        sp = body.get("sampling_params")
        total = prompt_sum = seqs = 0
        for i, p in enumerate(prompts):
            item = sp[i] if isinstance(sp, list) and i < len(sp) and isinstance(sp[i], Mapping) else sp
            item = item if isinstance(item, Mapping) else {}
            n = _n_or_one(item.get("n"))
            total += p + n * _completion(item.get("max_new_tokens"), cap)
            prompt_sum += p
            seqs += n
        key = None
        if len(prompts) == 1:
            ids, text = body.get("input_ids"), body.get("text")
            if isinstance(ids, list) and ids and type(ids[0]) is int and prompts[0] == len(ids):
                key = ids  # _prompts_generate read these ids (checked there)
            elif isinstance(text, str):
                key = text
        return total, prompt_sum, seqs, key
    n = _n_or_one(body.get("n"))
    key: Any = None
    if path.endswith("/responses"):
        max_new = body.get("max_output_tokens")
        inp = body.get("input")
        prompt = est(inp) if isinstance(inp, str) else (_messages_tokens(inp, est) or 0)
        instr = body.get("instructions")
        if isinstance(instr, str):
            prompt += est(instr) + CHAT_MESSAGE_OVERHEAD_TOKENS
        if body.get("tools"):
            prompt += est(_json_text(body["tools"]))  # tool schemas are rendered into the prompt
        prompts = [max(prompt, MIN_PROMPT_TOKENS)]
        key = _messages_key(([instr] if isinstance(instr, str) else []) + ([inp] if isinstance(inp, str) else
                            inp if isinstance(inp, list) else []), body.get("tools"))
    elif "messages" in body or path.endswith("/chat/completions"):
        max_new = _first_set(body, "max_completion_tokens", "max_tokens")
        prompt = _messages_tokens(body.get("messages"), est) or 0
        if body.get("tools"):
            prompt += est(_json_text(body["tools"]))
        prompts = [max(prompt, MIN_PROMPT_TOKENS)]
        key = _messages_key(body.get("messages"), body.get("tools"))
    else:  # /v1/completions and anything else carrying `prompt`
        max_new = _first_set(body, "max_completion_tokens", "max_tokens")
        prompts = _prompts_completions(body.get("prompt"), est) or [MIN_PROMPT_TOKENS]
        pr = body.get("prompt")
        key = pr if (isinstance(pr, str) or _is_int_list(pr)) and pr else None
    total = sum(p + n * _openai_budget(max_new, p, cap, ctx) for p in prompts)
    return total, sum(prompts), n * len(prompts), key if len(prompts) == 1 else None
def _first_set(body: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        v = body.get(k)
        if _int_or_none(v) is not None:
            return v
    return None
