"""Chained hashes of a prompt's leading blocks, with the per-unit work done in C (pure).

A prompt (token ids or text) is cut into blocks of ``block`` units. Key k covers blocks 1..k:
key_k = H(key_{k-1}, hash of block k), so two prompts share their first k keys exactly when they agree
on their first k blocks (up to 64-bit collisions). Each block is hashed by one C call -- Python's hash
of a tuple of ints (grouped by zip, no slice per block), or of a text slice (xxh3 of its UTF-8 bytes
for stable keys) -- and only the chain itself is a Python loop, one step per block (1,024 steps for a
64K-token prompt, not 65,536).

Stability: the keys of token ids are the same in every process (Python does not randomise the hash of
ints or of tuples of ints, unlike text: docs.python.org "object.__hash__"); :func:`stable_chain` also
hashes text with xxh3, so replicas can compare its keys through Redis. They depend on CPython's tuple
hash (unchanged since 3.8); tests/test_prefix_hash.py pins known values, so a change shows in CI.
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Sequence

import orjson
import xxhash

__all__ = ["BlockDigests", "is_token_ids", "chain", "stable_chain"]

_ID_CHARS = b"0123456789,-"
_X64 = xxhash.xxh3_64_intdigest
_X128 = xxhash.xxh3_128_digest


def is_token_ids(seq: Sequence[Any]) -> bool:
    """True when every item of ``seq`` is an int (not a bool, a float, a list...) within 64 bits; checked
    at C speed: orjson writes such a sequence with digits, commas and minus signs only. Empty: True."""
    try:
        text = orjson.dumps(seq)
    except TypeError:  # orjson.JSONEncodeError (an int beyond 64 bits, an unserialisable object)
        return False
    return not text[1:-1].translate(None, _ID_CHARS)


def _digests(seq: Sequence[int] | str, block: int, n_from: int, n_to: int, text_fast: bool) -> list[int]:
    """One hash per block n_from+1 .. n_to of ``seq``."""
    if isinstance(seq, str):
        if text_fast:
            return [hash(seq[i:i + block]) for i in range(n_from * block, n_to * block, block)]
        return [_X64(seq[i:i + block].encode("utf-8", "surrogatepass"))
                for i in range(n_from * block, n_to * block, block)]
    # zip(*[it] * block) groups the ids into block-sized tuples in C (the zip documentation's idiom) and
    # hands each to hash() without a slice per block: the same hash as hash(tuple(seq[i:i + block])).
    it = iter(seq) if n_from == 0 else islice(seq, n_from * block, None)
    return list(map(hash, islice(zip(*[it] * block), max(0, n_to - n_from))))


class BlockDigests:
    """One request's block hashes, kept for the next reader of the same prompt: admission's prefix blocks and
    placement's prefix keys chain the same block hashes from different starts, so a prompt is hashed once
    (an 8K-token prompt: ~50 us of the ~60 us a chain costs). Holds the sequence it hashed, so a later
    sequence is recognised by identity only while this one is alive (no id reuse). Per request, not shared."""

    __slots__ = ("seq", "block", "digests")

    def __init__(self) -> None:
        self.seq: Any = None
        self.block = 0
        self.digests: list[int] = []

    def get(self, seq: Any, block: int, n_to: int) -> list[int] | None:
        """The hashes of blocks 1 .. n_to of ``seq`` when this holds them, else None."""
        if seq is self.seq and block == self.block and n_to <= len(self.digests):
            return self.digests if n_to == len(self.digests) else self.digests[:n_to]
        return None


def chain(seq: Sequence[int] | str, block: int, start: int, n_from: int = 0, n_to: int | None = None,
          memo: BlockDigests | None = None) -> list[int]:
    """In-process chain keys continuing from ``start`` over blocks n_from+1 .. n_to of ``seq`` (token ids
    or a str; blocks are counted from seq[0]; n_to None = every full block). Returns [start,
    key(n_from+1), ..., key(n_to)]. Text blocks use Python's str hash, randomised per process: for keys
    shared between processes use :func:`stable_chain`. ``memo``: the request's block hashes, read when it
    holds this sequence's and filled when not (n_from 0 only). Raises TypeError for unhashable items."""
    if n_to is None:
        n_to = len(seq) // block
    if n_to <= n_from:  # no whole block (a short prompt): nothing to hash
        return [start]
    digests = memo.get(seq, block, n_to) if memo is not None and n_from == 0 else None
    if digests is None:
        digests = _digests(seq, block, n_from, n_to, True)
        if memo is not None and n_from == 0:
            memo.seq, memo.block, memo.digests = seq, block, digests
    out = [start]
    h = start
    for d in digests:
        h = hash((h, d))
        out.append(h)
    return out


def stable_chain(units: Sequence[int] | str, block: int) -> list[bytes]:
    """128-bit chain keys of ``units`` (token ids or text) after 1, 2, ... full blocks of ``block`` units,
    the same in every process: key_k = xxh3-128(key_{k-1} + the block's 64-bit digest). Raises TypeError
    for units that are neither text nor ints within 64 bits."""
    is_text = isinstance(units, str)
    if not is_text:
        units = units if isinstance(units, tuple) else tuple(units)
        if not is_token_ids(units):
            raise TypeError("units must be text or integer token ids")
    prev = _X128(b"t" if is_text else b"i")
    out = []
    for d in _digests(units, block, 0, len(units) // block, False):  # type: ignore[arg-type]
        prev = _X128(prev + (d & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little"))
        out.append(prev)
    return out
