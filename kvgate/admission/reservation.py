"""Reservation estimate: how many KV tokens a request may occupy (pure, no I/O except the optional loader).

Rule (Relax's ledger): reservation = prompt tokens + completion budget, the completion part bounded
by min(max_new_tokens or SGLang's default 128, expected_decode_cap); batch and n>1 requests reserve for every
sequence. The 128 default comes from SGLang srt/managers/io_struct.py / srt/sampling/sampling_params.py
(``max_new_tokens`` defaults to 128).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

__all__ = [
    "SGLANG_DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_CHARS_PER_TOKEN",
    "CHAT_MESSAGE_OVERHEAD_TOKENS",
    "MIN_PROMPT_TOKENS",
    "TokenCounter",
    "estimate_reservation",
    "estimate_text_tokens",
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


def load_tokenizer_counter(path: str) -> TokenCounter:
    """Load a Hugging Face ``tokenizer.json`` file and return a text -> token-count callable.

    This is the only I/O in the admission core and happens once at startup. Raises ImportError if the
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


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


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


def estimate_reservation(
    path: str,
    body: Any,
    *,
    expected_decode_cap: int,
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
    tokenizer: TokenCounter | None = None,
) -> int:
    """KV tokens to reserve for one request: sum over sequences of (prompt tokens + completion budget).

    Takes the request ``path`` (/generate, /v1/completions, /v1/chat/completions, /v1/responses; query
    string and trailing slash ignored) and its parsed JSON ``body``. Completion budget per sequence =
    min(max_new_tokens, expected_decode_cap) where max_new_tokens is ``sampling_params.max_new_tokens``
    (/generate; per-item when sampling_params is a list), ``max_completion_tokens`` or ``max_tokens``
    (OpenAI completions/chat) or ``max_output_tokens`` (responses), defaulting to SGLang's 128
    (srt/managers/io_struct.py). Sequences: batch items x n (``sampling_params.n`` for /generate, ``n`` for
    OpenAI). Prompt tokens: len(input_ids) / token-id prompts exactly; text, chat messages (plus
    CHAT_MESSAGE_OVERHEAD_TOKENS per message, plus ``tools`` JSON) and responses ``input``/``instructions``
    estimated with ``tokenizer`` if given else ceil(chars / chars_per_token).
    Never raises on odd bodies: an unreadable prompt counts MIN_PROMPT_TOKENS. Raises ValueError only for a
    bad configuration (expected_decode_cap <= 0 or chars_per_token <= 0). Returns an int >= 1.
    """
    if isinstance(expected_decode_cap, bool) or not isinstance(expected_decode_cap, int) or expected_decode_cap <= 0:
        raise ValueError(f"expected_decode_cap must be a positive int, got {expected_decode_cap!r}")
    if not (isinstance(chars_per_token, (int, float)) and math.isfinite(chars_per_token) and chars_per_token > 0):
        raise ValueError(f"chars_per_token must be > 0, got {chars_per_token!r}")
    cap = expected_decode_cap

    def est(text: str) -> int:
        return estimate_text_tokens(text, chars_per_token=chars_per_token, tokenizer=tokenizer)

    try:
        return max(1, _estimate(_norm_path(path), body, cap, est))
    except Exception:
        return MIN_PROMPT_TOKENS + min(SGLANG_DEFAULT_MAX_NEW_TOKENS, cap)


def _norm_path(path: Any) -> str:
    p = str(path or "").split("?", 1)[0]
    return p.rstrip("/") or "/"


def _estimate(path: str, body: Any, cap: int, est: Callable[[str], int]) -> int:
    fallback = MIN_PROMPT_TOKENS + min(SGLANG_DEFAULT_MAX_NEW_TOKENS, cap)
    if not isinstance(body, Mapping):
        return fallback
    if path.endswith("/generate") or ("sampling_params" in body and "messages" not in body):
        prompts = _prompts_generate(body, est) or [MIN_PROMPT_TOKENS]
        sp = body.get("sampling_params")
        total = 0
        for i, p in enumerate(prompts):
            item = sp[i] if isinstance(sp, list) and i < len(sp) and isinstance(sp[i], Mapping) else sp
            item = item if isinstance(item, Mapping) else {}
            n = _n_or_one(item.get("n"))
            total += n * (p + _completion(item.get("max_new_tokens"), cap))
        return total
    n = _n_or_one(body.get("n"))
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
    elif "messages" in body or path.endswith("/chat/completions"):
        max_new = _first_set(body, "max_completion_tokens", "max_tokens")
        prompt = _messages_tokens(body.get("messages"), est) or 0
        if body.get("tools"):
            prompt += est(_json_text(body["tools"]))
        prompts = [max(prompt, MIN_PROMPT_TOKENS)]
    else:  # /v1/completions and anything else carrying `prompt`
        max_new = _first_set(body, "max_completion_tokens", "max_tokens")
        prompts = _prompts_completions(body.get("prompt"), est) or [MIN_PROMPT_TOKENS]
    comp = _completion(max_new, cap)
    return sum(n * (p + comp) for p in prompts)


def _first_set(body: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        v = body.get(k)
        if _int_or_none(v) is not None:
            return v
    return None
