"""Stable fingerprints of a prompt and its output, equal on every replica (pure).

Session inference indexes prompts by Python's ``hash``, which is randomised per process for text.
Replicas that share an index need a hash every process agrees on: chain keys over blocks of the same
size session inference uses (``session_inference_block_tokens`` ids or ``_block_chars`` characters),
chained so block k's key depends on blocks 1..k (kvgate.common.prefix_hash.stable_chain: one C hash per
block, xxh3-128 along the chain).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

from kvgate.common import prefix_hash

_DIGEST = 12  # bytes: a collision among a deployment's live sessions is negligible


def _bytes(units: Sequence[int] | str) -> bytes:
    if isinstance(units, str):
        return units.encode("utf-8", "surrogatepass")
    return array("q", units).tobytes()


def chain(units: Sequence[int] | str, block: int) -> list[str]:
    """Hex chain keys of ``units`` (token ids or text) after 1, 2, ... full blocks of ``block`` units.
    Raises TypeError for units that are neither text nor 64-bit integers."""
    return [k.hex() for k in prefix_hash.stable_chain(units, block)]


def tail(units: Sequence[int] | str, start: int, end: int) -> str:
    """Hex fingerprint of ``units[start:end]`` (the part after the last full block)."""
    return hashlib.blake2b(_bytes(units[start:end]), digest_size=_DIGEST).hexdigest()


def turn_link(prompt: Sequence[int] | str, output: Sequence[int] | str, block: int) -> tuple[str, int, str] | None:
    """What a completed turn leaves for the other replicas: (chain key of P + O at its last full block,
    len(P + O), fingerprint of the units after that block). None when P + O is shorter than one block or
    the kinds differ (token prompt, text output)."""
    if isinstance(prompt, str) != isinstance(output, str):
        return None
    seq = prompt + output if isinstance(prompt, str) else list(prompt) + list(output)
    keys = chain(seq, block)
    if not keys:
        return None
    n = len(keys)
    return keys[-1], len(seq), tail(seq, n * block, len(seq))


def continues(units: Sequence[int] | str, block: int, length: int, tail_fp: str) -> bool:
    """True when ``units`` (a new request) extends a P + O of ``length`` units whose last full block's
    chain key already matched, and whose units after that block fingerprint to ``tail_fp``."""
    n = length // block
    return len(units) > length and tail(units, n * block, length) == tail_fp
