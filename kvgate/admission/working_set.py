"""Tokens held on each KV pool, with shared prompt prefixes counted once (pure, no I/O).

A holder (a lease, or a program's resident KV) holds ``blocks`` (hashes of its prompt's leading
fixed-size blocks, each chained to the previous one so equal hashes mean equal prefixes) plus ``tail``
tokens of its own (the rest of the prompt, the output, the decode budget). On one place (an engine, one
data-parallel rank of it, or the whole fleet when the engine is unknown) a block held by several
holders is counted once: SGLang's radix cache keeps one copy of a shared prefix and every request that
matches it reuses it (SGLang's python/sglang/srt/mem_cache/radix_cache.py, ``match_prefix``: the longest
cached prefix; a running request's prompt is shareable once its prefill ends). So eight siblings over one
8,000-token prompt hold 8,000 + 8 x their own tokens, not 8 x 8,000.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import add, itemgetter, sub
from typing import Hashable, Iterable

__all__ = ["DEFAULT_BLOCK_TOKENS", "FLEET", "Holdings"]

#: Tokens per prefix block. Small enough that a sibling's prompt shares almost all of it, large enough
#: that a 100k-token prompt hashes in ~1,600 steps.
DEFAULT_BLOCK_TOKENS = 64

#: The place of a holder whose engine is not known: the fleet as a whole.
FLEET: Hashable = None


@dataclass(slots=True)
class _Place:
    refs: dict[int, int] = field(default_factory=dict)
    tail: int = 0
    holders: int = 0
    # blocks not held here, per prompt asked about since the place last changed: id(blocks) -> (blocks, count).
    # A waiting turn is asked about on every pump, on each engine it may go to, and its refusal asks again;
    # while the place holds the same blocks the answer is the same, and the set difference behind it is the
    # costliest step of a refusal. Cleared whenever a holder comes or goes.
    cache: dict[int, tuple[tuple, int]] = field(default_factory=dict)
    freeing: int = 0  # blocks a removal freed that refs still counts (Holdings._pending)


#: Prompts remembered per place between changes (a bound for a place that stays unchanged for long).
_CACHED_PER_PLACE = 256

#: Changes the log keeps (changed_since): beyond it the older half goes.
_LOG_KEPT = 4096


def _held_prefix(refs: dict, blocks: tuple) -> int:
    """How many leading ``blocks`` ``refs`` holds, by a binary search: exact for chain hashes (the blocks a place
    holds of such a prompt are a prefix of it), a guess to be checked otherwise."""
    lo, hi = 0, len(blocks)
    while lo < hi:  # blocks[:lo] held, blocks[hi:] not
        mid = (lo + hi) // 2
        if blocks[mid] in refs:
            lo = mid + 1
        else:
            hi = mid
    return lo


class Holdings:
    """Per-place token holdings. ``block_tokens``: tokens each block stands for (> 0, else ValueError).

    Figures are exact integer tokens: total(place) = distinct blocks x block_tokens + sum of tails.
    """

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
            raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
        self.block_tokens = block_tokens
        self._places: dict[Hashable, _Place] = {}
        self._holders: dict[Hashable, tuple[Hashable, tuple[int, ...], int]] = {}
        self._total = 0  # grand_total(), kept as holdings come and go: every admission reads it
        # places whose total changed since the owner last read this set (kvgate.admission.free_rank keeps the
        # engines ordered by free room from it; bounded by the places ever held)
        self.touched: set[Hashable] = set()
        # the same changes in order, one place per change: changed_since(version) names the places a change
        # reached since then (a waiting turn's refusals hold while none of its places changed); the last
        # _LOG_KEPT changes at most (older versions answer None)
        self._log: list[Hashable] = []
        self._log_base = 0  # the version before _log[0]
        # The last removal's block counts, not yet taken off its place's refs: (place, its _Place, blocks, their
        # counts before it). A turn's end releases its lease and holds its prompt again as the program's resident
        # KV; the program's next turn releases that and holds the longer prompt in a lease (kvgate.admission.program).
        # Each time the blocks released are held again at once: taking them off refs and putting them back (dict
        # deletes and inserts, a few hundred per turn) was most of what a turn's bookkeeping cost. An add on the
        # same place whose prompt starts with those blocks keeps them (_hand_over); a cost there that covers them
        # counts them as freed. Anything else that reads or writes that place's blocks takes them off first
        # (_settle); totals count the removal at once (_Place.freeing).
        self._pending: tuple | None = None
        # (the last prompt tuple cost() read, its set of blocks, how many): a waiting turn's prompt is read on
        # every engine it may go to, and again by the grant that follows
        self._distinct: tuple = ((), frozenset(), 0)
        # first block -> {place: holders there whose blocks start with it (the pending removal's until it settles:
        # a hand-over keeps it)}: where a prompt's start is held, read without a lookup in every place's blocks (a
        # moving turn asks on every pass; 64 large dicts were ~30 us)
        self._starts: dict[int, dict[Hashable, int]] = {}

    def cost(self, place: Hashable, blocks: Iterable[int], tail: int) -> int:
        """Tokens that adding (blocks, tail) on ``place`` would add: blocks not yet held there + tail."""
        p = self._places.get(place)
        if p is None:
            return len(set(blocks)) * self.block_tokens + max(0, int(tail))
        if type(blocks) is tuple:  # noqa: E721 (a tuple is the only kind remembered: it cannot change)
            hit = p.cache.get(id(blocks))
            if hit is not None and hit[0] is blocks:  # the very object (it is kept, so its id is not reused)
                return hit[1] * self.block_tokens + max(0, int(tail))
        pending = self._pending
        if pending is not None and pending[1] is p:
            held = pending[2]
            if type(blocks) is tuple and blocks[:len(held)] == held:  # noqa: E721
                # the prompt goes on from the holding just released (a program's next turn): those blocks are in
                # refs still (what the removal freed is held again, counted by freeing), the rest is read alone
                new = len(set(blocks[len(held):]).difference(p.refs)) + p.freeing
                return self._remember(p, blocks, new) * self.block_tokens + max(0, int(tail))
            distinct = self._distinct_of(blocks)[1]  # set operations: C speed, not a Python step per block
            if distinct.issuperset(held):  # every block the removal freed would be added again
                new = len(distinct.difference(p.refs)) + p.freeing
            else:
                self._settle()
                new = len(distinct.difference(p.refs))
        elif type(blocks) is tuple and p.refs.keys().isdisjoint(blocks):  # noqa: E721
            # none held here (a prompt asked about on every engine: most hold none of it): a lookup a block,
            # no set built; its distinct count is the same on every place
            new = self._distinct_of(blocks)[2]
        else:  # the engines that hold its start: one set of the prompt for all of them
            new = len(self._distinct_of(blocks)[1].difference(p.refs))
        return self._remember(p, blocks, new) * self.block_tokens + max(0, int(tail))

    @staticmethod
    def _remember(p: _Place, blocks: Iterable[int], new: int) -> int:
        """Keep ``new`` (blocks of ``blocks`` not held on ``p``) until ``p`` changes; returns it."""
        if type(blocks) is tuple:  # noqa: E721
            if len(p.cache) >= _CACHED_PER_PLACE:
                p.cache.clear()
            p.cache[id(blocks)] = (blocks, new)
        return new

    def cost_chained(self, place: Hashable, blocks: tuple, tail: int) -> int:
        """cost() of chain-hashed ``blocks`` (kvgate's: the blocks a place holds of such a prompt are a prefix of
        it), the held prefix found by a binary search instead of a walk of every block; cost() itself where
        ``blocks`` repeat a block or a removal is pending on ``place``."""
        p = self._places.get(place)
        if p is None or type(blocks) is not tuple or (self._pending is not None and self._pending[1] is p):  # noqa: E721
            return self.cost(place, blocks, tail)
        hit = p.cache.get(id(blocks))
        if hit is not None and hit[0] is blocks:
            return hit[1] * self.block_tokens + max(0, int(tail))
        if self._distinct_of(blocks)[2] != len(blocks):
            return self.cost(place, blocks, tail)
        lo = _held_prefix(p.refs, blocks)
        return self._remember(p, blocks, len(blocks) - lo) * self.block_tokens + max(0, int(tail))

    def cost_alone(self, blocks: Iterable[int], tail: int) -> int:
        """cost() on a place that holds none of ``blocks``: every distinct block + tail (tokens)."""
        return self._distinct_of(blocks)[2] * self.block_tokens + max(0, int(tail))

    def _distinct_of(self, blocks: Iterable[int]) -> tuple:
        """(blocks, the set of them, its size), remembered for the last tuple asked about (kept, so its id is
        not reused; the set is never changed)."""
        memo = self._distinct
        if memo[0] is not blocks:
            distinct = set(blocks)
            memo = (blocks, distinct, len(distinct))
            if type(blocks) is tuple:  # noqa: E721 (only a tuple cannot change)
                self._distinct = memo
        return memo

    def add(self, holder: Hashable, place: Hashable, blocks: Iterable[int], tail: int) -> int:
        """Hold (blocks, tail) for ``holder`` on ``place``; returns the tokens it added. A holder already
        holding something is replaced (its old holding released first)."""
        if holder in self._holders:
            self.remove(holder)
        t = max(0, int(tail))
        bl: tuple = ()
        if blocks:  # distinct, order kept (the tuple itself when it has no repeat: _hand_over knows it by identity)
            pending = self._pending
            if blocks is (pending[2] if pending is not None else None):
                bl = blocks  # the very tuple the pending removal held: distinct already
            elif blocks is self._distinct[0] and self._distinct[2] == len(blocks):
                bl = blocks  # the tuple cost() just read (the grant that follows it): no repeat in it
            elif pending is not None and type(blocks) is tuple and blocks[:len(pending[2])] == pending[2] and \
                    self._fresh(pending[1], blocks[len(pending[2]):]):  # noqa: E721
                bl = blocks  # goes on from the removal's blocks (distinct) with blocks new there, none repeated
            else:
                distinct = dict.fromkeys(blocks)
                bl = blocks if type(blocks) is tuple and len(distinct) == len(blocks) else tuple(distinct)  # noqa: E721
        p = self._places.get(place)
        pending = self._pending
        if pending is not None and pending[1] is p:
            held = pending[2]
            if bl is held or bl[:len(held)] == held:
                return self._hand_over(holder, place, bl, t)
            self._settle()
        if p is None:
            p = self._places[place] = _Place()
        elif p.cache:
            p.cache.clear()
        self._touch(place)
        added = self._count_in(p, bl) * self.block_tokens + t
        p.tail += t
        p.holders += 1
        self._holders[holder] = (place, bl, t)
        if bl:  # inline (every turn adds twice): _starts[bl[0]][place] += 1
            at = self._starts.get(bl[0])
            if at is None:
                self._starts[bl[0]] = {place: 1}
            else:
                at[place] = at.get(place, 0) + 1
        self._total += added
        return added

    @staticmethod
    def _fresh(p: _Place, rest: tuple) -> bool:
        """Whether ``rest`` repeats no block and holds none ``p`` holds (a fortiori none of a removal's there)."""
        return len(set(rest)) == len(rest) and p.refs.keys().isdisjoint(rest)

    @staticmethod
    def _count_in(p: _Place, bl: tuple) -> int:
        """refs[b] += 1 for every block of ``bl`` (distinct) on ``p`` (in C: map/zip, not a Python step per
        block); returns how many were not held there."""
        if not bl:
            return 0
        refs = p.refs
        keys = refs.keys()
        if keys.isdisjoint(bl):  # none held here (a turn moved to an engine without its prompt): no counts to read
            refs.update(zip(bl, repeat(1)))
            return len(bl)
        # Chain hashes: the blocks held here are a prefix of the prompt (found by a binary search), the rest new;
        # checked (a repeat or a hole in the prefix takes the general way)
        lo = _held_prefix(refs, bl)
        rest = bl[lo:]
        if lo and keys.isdisjoint(rest):
            head = bl[:lo]
            try:
                counts = list(map(refs.__getitem__, head))
            except KeyError:
                pass
            else:
                refs.update(zip(head, map(add, counts, repeat(1))))
                refs.update(zip(rest, repeat(1)))
                return len(rest)
        old = list(map(refs.get, bl, repeat(0)))
        refs.update(zip(bl, map(add, old, repeat(1))))
        return old.count(0)

    def _hand_over(self, holder: Hashable, place: Hashable, bl: tuple, tail: int) -> int:
        """add() on the pending removal's place of ``bl``, which starts with the blocks it released: those stay
        in refs as they are (what the removal freed is held again), only the rest is counted in. Returns the
        tokens added."""
        _, p, held, _ = self._pending
        self._pending = None
        new, p.freeing = p.freeing, 0
        if len(bl) > len(held):
            new += self._count_in(p, bl[len(held):])
        p.tail += tail
        p.holders += 1
        self._holders[holder] = (place, bl, tail)  # its start counted already: the removal's, the same block
        self._touch(place)
        if p.cache:
            p.cache.clear()
        added = new * self.block_tokens + tail
        self._total += added
        return added

    def _settle(self) -> None:
        """Take the pending removal's blocks off its place's refs (counts were read when it was removed, and no
        block has changed there since: every change there settles first)."""
        place, p, bl, counts = self._pending
        self._pending = None
        self._unstart(bl[0], place)  # the removal's start, counted until now (a hand-over keeps it)
        refs = p.refs
        freeing, p.freeing = p.freeing, 0
        k = len(bl) - freeing
        if freeing and counts[k] == 1 and counts.index(1) == k:
            # chain hashes: a block's count is no more than the one before it, so the freed blocks (count 1) are
            # the last ones: those go, only the shared ones before them are counted down (checked: the first
            # count of 1 is at k, and there are exactly ``freeing`` of them)
            deque(map(refs.__delitem__, bl[k:]), maxlen=0)
            refs.update(zip(bl[:k], map(sub, counts[:k], repeat(1))))
            return
        refs.update(zip(bl, map(sub, counts, repeat(1))))
        if freeing:
            deque(map(refs.__delitem__, compress(bl, map((1).__eq__, counts))), maxlen=0)

    def remove(self, holder: Hashable) -> int:
        """Release ``holder``'s holding; returns the tokens freed (0 if it held none: idempotent)."""
        h = self._holders.pop(holder, None)
        if h is None:
            return 0
        if self._pending is not None:
            self._settle()
        place, bl, tail = h
        p = self._places[place]
        self._touch(place)
        if p.cache:
            p.cache.clear()
        if p.holders == 1:  # the place's last holder: every block it holds is its alone
            if bl:
                self._unstart(bl[0], place)
            del self._places[place]
            freed = len(bl) * self.block_tokens + tail
            self._total -= freed
            return freed
        refs = p.refs
        freed = tail
        if bl:  # counted now, taken off refs by the next add (or by anything else that reads blocks)
            counts = itemgetter(*bl)(refs) if len(bl) > 1 else (refs[bl[0]],)
            p.freeing = counts.count(1)  # blocks no other holder holds: freed
            self._pending = (place, p, bl, counts)
            freed += p.freeing * self.block_tokens
        p.tail -= tail
        p.holders -= 1
        self._total -= freed
        return freed

    def _unstart(self, block: int, place: Hashable) -> None:
        """_starts[block][place] -= 1, emptied entries dropped."""
        at = self._starts[block]
        n = at[place] - 1
        if n:
            at[place] = n
        elif len(at) > 1:
            del at[place]
        else:
            del self._starts[block]

    def _touch(self, place: Hashable) -> None:
        self.touched.add(place)
        log = self._log
        log.append(place)
        if len(log) > _LOG_KEPT:
            del log[: _LOG_KEPT // 2]
            self._log_base += _LOG_KEPT // 2

    @property
    def version(self) -> int:
        """How many changes (a holder added or removed) there have been: grows with each."""
        return self._log_base + len(self._log)

    def changed_since(self, version: int) -> set[Hashable] | None:
        """The places whose holdings changed since ``version`` (an earlier ``version``), or None when that is
        older than the changes kept (then any place may have)."""
        i = version - self._log_base
        return set(self._log[i:]) if i >= 0 else None

    def has_block(self, place: Hashable, block: int) -> bool:
        """Whether some holder on ``place`` holds ``block``."""
        p = self._places.get(place)
        return p is not None and block in p.refs and not self._freed(p, block)

    def places_starting_with(self, block: int) -> set[Hashable]:
        """The places where some holder's blocks start with ``block``, in O(1) of the places. For chain hashes
        (a block's hash covers every block before it, as kvgate's do) a first block is held only as a first
        block: for a prompt's first block these are the places where has_block is true."""
        at = self._starts.get(block)
        if not at:
            return set()
        out = set(at)
        pending = self._pending  # a removal not settled yet counts its start until then
        if pending is not None and pending[2][0] == block and at.get(pending[0]) == 1:
            out.discard(pending[0])
        return out

    def _freed(self, p: _Place, block: int) -> bool:
        """Whether ``block``, in ``p``'s refs, is one the pending removal freed there (read without settling it:
        a scan of that removal's blocks, in C)."""
        pending = self._pending
        if pending is None or pending[1] is not p or not p.freeing:
            return False
        held, counts = pending[2], pending[3]
        try:
            return counts[held.index(block)] == 1
        except ValueError:
            return False

    def holds(self, holder: Hashable) -> bool:
        return holder in self._holders

    def place_of(self, holder: Hashable) -> Hashable:
        h = self._holders.get(holder)
        return None if h is None else h[0]

    def size_of(self, holder: Hashable) -> int:
        """The holder's own size if it were alone (blocks x block_tokens + tail), 0 if it holds nothing."""
        h = self._holders.get(holder)
        return 0 if h is None else len(h[1]) * self.block_tokens + h[2]

    def total(self, place: Hashable) -> int:
        """Tokens held on ``place``."""
        p = self._places.get(place)
        return 0 if p is None else (len(p.refs) - p.freeing) * self.block_tokens + p.tail

    def grand_total(self) -> int:
        """Tokens held on every place together (blocks shared only within a place): the sum of total(place)
        over places, kept as holders come and go."""
        return self._total

    def places(self) -> list[Hashable]:
        return list(self._places)

    def __len__(self) -> int:
        return len(self._holders)
