"""The Mooncake conversation trace: records, token ids from hash blocks, sessions from hash chains (pure).

Trace format (Mooncake's published traces): one JSON object a line with timestamp (ms from start),
input_length, output_length and hash_ids (512-token prefix blocks; equal ids = a reusable prefix).
There are no session fields: a request whose hash_ids extend an earlier request's FULL blocks
(floor(input_length / 512) of them) continues that request's session. Block 0 (a shared system
prompt) would make every request extend every one-block request, so a continuation must share at
least ``min_shared_blocks`` blocks (default 2).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

BLOCK_TOKENS = 512
VOCAB = 32000


@dataclass(frozen=True)
class TraceRecord:
    """One trace request: timestamp in ms, token lengths, hash block ids."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def full_blocks(self) -> tuple[int, ...]:
        return self.hash_ids[: self.input_length // BLOCK_TOKENS]


def read_trace(path: str | Path, start_ms: int = 0, duration_ms: int | None = None) -> list[TraceRecord]:
    """Records with start_ms <= timestamp < start_ms + duration_ms (all after start_ms when None).
    Timestamps are kept as in the file. Raises ValueError on a malformed line (naming the line)."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                rec = TraceRecord(int(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]),
                                  tuple(int(h) for h in obj["hash_ids"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a trace record ({exc})") from None
            if rec.timestamp_ms < start_ms:
                continue
            if duration_ms is not None and rec.timestamp_ms >= start_ms + duration_ms:
                break
            out.append(rec)
    return out


def block_tokens(hash_id: int) -> list[int]:
    """The 512 deterministic token ids (1..VOCAB-1) standing for one hash block."""
    out: list[int] = []
    counter = 0
    while len(out) < BLOCK_TOKENS:
        digest = hashlib.blake2b(f"{hash_id}:{counter}".encode(), digest_size=64).digest()
        out.extend(1 + int.from_bytes(digest[i:i + 2], "little") % (VOCAB - 1) for i in range(0, 64, 2))
        counter += 1
    return out[:BLOCK_TOKENS]


class TokenBook:
    """Caches block token ids so a long replay builds each block once."""

    def __init__(self) -> None:
        self._blocks: dict[int, list[int]] = {}

    def prompt(self, rec: TraceRecord) -> list[int]:
        """The request's input_ids: its blocks' tokens, cut to input_length."""
        ids: list[int] = []
        for h in rec.hash_ids:
            blk = self._blocks.get(h)
            if blk is None:
                blk = self._blocks[h] = block_tokens(h)
            ids.extend(blk)
            if len(ids) >= rec.input_length:
                break
        return ids[: rec.input_length]

    def prompt_text(self, rec: TraceRecord) -> str:
        """The same prompt as text of exactly input_length ASCII letters, one per token id, for routes that
        take only text (smg 1.13's /v1/completions rejects token-id prompts). An engine that tokenizes one
        token per byte (the simulator, kvgate.sim.tokenizer) sees the same block structure."""
        return "".join(chr(97 + t % 26) for t in self.prompt(rec))


def infer_sessions(records: Iterable[TraceRecord], min_shared_blocks: int = 2) -> list[str]:
    """A session id for every record, in order: a record whose hash_ids start with an earlier record's
    full blocks (at least ``min_shared_blocks`` of them; the longest such prefix wins, then the most
    recent record) joins that record's session; otherwise it starts session "s<index>"."""
    by_prefix: dict[tuple[int, ...], str] = {}
    out: list[str] = []
    for i, rec in enumerate(records):
        sid = None
        for n in range(len(rec.hash_ids), min_shared_blocks - 1, -1):
            sid = by_prefix.get(rec.hash_ids[:n])
            if sid is not None:
                break
        if sid is None:
            sid = f"s{i}"
        out.append(sid)
        full = rec.full_blocks
        if len(full) >= min_shared_blocks:
            by_prefix[full] = sid
    return out


def turn_gaps(records: Iterable[TraceRecord], sessions: Iterable[str]) -> list[float]:
    """The gaps between a session's consecutive turns, seconds of trace time (arrival to arrival; the session
    is idle for the gap less its turn's own time), in trace order; a one-turn session adds none. Pure."""
    last: dict[str, int] = {}
    gaps = []
    for rec, sid in zip(records, sessions):
        if sid in last:
            gaps.append((rec.timestamp_ms - last[sid]) / 1000.0)
        last[sid] = rec.timestamp_ms
    return gaps


def iter_turns(records: list[TraceRecord], sessions: list[str]) -> Iterator[tuple[TraceRecord, str, int]]:
    """(record, session id, turn number starting at 1) in trace order."""
    turns: dict[str, int] = {}
    for rec, sid in zip(records, sessions):
        turns[sid] = turns.get(sid, 0) + 1
        yield rec, sid, turns[sid]
