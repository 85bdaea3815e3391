"""Deterministic toy tokenizer and chat template for the simulator (pure functions).

Encoding: UTF-8 bytes, token id = byte + 3 (ids 0..2 are pad/bos/eos), so ``len(ids)`` is the
number of UTF-8 bytes and ``decode(encode(s)) == s``. The default ("byte") model outputs only
printable-ASCII byte ids, so ``encode(decode(out)) == out`` too and multi-turn text prompts
re-use the cached output. Decoding of ids outside the byte range (the "wide" model's outputs,
ids in [0, 32000)) renders each as a space plus a base-26 lowercase word
(id 3+256=259 -> " a" ... deterministic, not meant to be readable); EOS (2) and ids 0/1
render as "".

Chat template: each message becomes ``"<|{role}|>\\n{content}\\n"``; the prompt ends with
``"<|assistant|>\\n"``. List contents keep their ``{"type":"text"}`` parts joined by "".
"""

from __future__ import annotations

from typing import Iterable

BYTE_OFFSET = 3


def encode(text: str) -> list[int]:
    """Text -> token ids (one per UTF-8 byte, offset by 3)."""
    return [b + BYTE_OFFSET for b in text.encode("utf-8")]


def _word(i: int) -> str:
    n = i - (BYTE_OFFSET + 256)
    letters = []
    while True:
        n, r = divmod(n, 26)
        letters.append(chr(97 + r))
        if n == 0:
            break
    return "".join(reversed(letters))


def decode(ids: Iterable[int]) -> str:
    """Token ids -> text: byte ids back to UTF-8 (errors replaced), others to " <word>"."""
    parts: list[str] = []
    buf = bytearray()
    for t in ids:
        t = int(t)
        if BYTE_OFFSET <= t < BYTE_OFFSET + 256:
            buf.append(t - BYTE_OFFSET)
            continue
        if buf:
            parts.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
        if t >= BYTE_OFFSET + 256:
            parts.append(" " + _word(t))
    if buf:
        parts.append(buf.decode("utf-8", errors="replace"))
    return "".join(parts)


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def render_chat(messages: list[dict]) -> str:
    """OpenAI messages -> prompt text with the template documented above. Raises ValueError."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError("each message needs a role")
        out.append(f"<|{m['role']}|>\n{_content_text(m.get('content'))}\n")
    out.append("<|assistant|>\n")
    return "".join(out)
