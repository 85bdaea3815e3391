"""Session placement: which engine (and DP rank) a session's generate calls go to when kvgate places them (pure).

No I/O and no clock of its own: calls that care about time take ``now`` (monotonic seconds). The edge
(kvgate.proxy.app) feeds it the engine list (kvgate.fleet.directory), the engines' KV figures (the capacity
poller's snapshot, engine-reported) and each call's prompt prefix keys, and sends the call where it says.

Rules (docs/placement.md):
  - sticky: a placed session stays on its engine and DP rank while that engine is usable; its radix cache
    holds the session's prefix. On an engine with DP > 1 a rank is pinned with ``routed_dp_rank``
    (otherwise SGLang's DP controller round-robins and splits the prefix across ranks' radix trees:
    python/sglang/srt/managers/data_parallel_controller.py).
  - prefix: a new session whose prompt extends a prompt kvgate already placed (GRPO siblings share the
    task prompt; a session reopened after a close continues its old prompt) goes to that prompt's engine and
    rank while that rank's projected KV with the session (below) stays under ``pressure_threshold`` x its
    capacity, or while no other usable rank would have more projected free room after taking the session and
    paying the re-prefill of the shared prefix (moving then wins no room and loses the prefix's cache hit:
    counted ``pressed_stay``; otherwise it is placed by free KV, counted ``kv_moved``), and while that engine
    is not the busier one in compute: its running plus
    waiting requests (engine-reported, plus kvgate's calls its figures cannot include yet) are at most the
    least busy other usable engine's plus ``busier_margin`` (None: load never moves a session off its prefix).
    Otherwise siblings over one long shared prompt pile onto one engine while another idles: a shared prefix
    saves one prefill, a queue costs every call behind it. The margin (4 by default) is there because two busy
    engines' counts differ by one or two most of the time: at 0 placement moved most GRPO siblings off their
    group's engine and lost the cache (docs/benchmark.md). Prompts are matched by chain hashes over fixed
    blocks (kvgate.sessions.inference's fingerprint), at block granularity: the longest indexed prefix wins.
  - projected KV of a rank: max(engine-reported used + in-flight prompt tokens, held) + growth. ``held`` is
    kvgate's ledger of the KV its live sessions there hold: each session's largest prompt + output seen
    (call_started's prompt, observed()'s prompt + output), a group's shared prefix counted once per rank.
    ``growth`` is what they are expected to add: a session's group is the indexed prompt it matched when it
    was placed (its siblings), and each session is expected to grow to the largest size any session of its
    group reached, live or ended (the group's ``grown``), so growth = sum of (grown - own largest). The max,
    not a sum: SGLang counts a session's KV in used while the session holds it (session lifecycle on) and as
    evictable, outside used, otherwise; the ledger is a floor in both cases, and adding the two would count
    held KV twice. A new session's expected size is max(its group's grown, its prompt); on a rank where its
    group has live sessions it adds that minus the shared prefix (already cached there), elsewhere all of it
    (the re-prefill). Why: eight agents over one ~3,000-token prompt sent one after another each found the
    prefix's engine idle and under the threshold (the KV they would grow to is in no engine figure yet, and
    with KV evictable between turns it never is), so all eight went there (8 + 0) and evicted each other's
    context. The ledger is kept as running sums per rank (and per group and rank: live sessions and the sum
    of their largest sizes), changed by each event, so a placement costs O(engine ranks) and never scans the
    sessions; a forgotten session stops counting (its group's ``grown`` stays, groups bounded by
    ``max_prefixes``).
  - free KV: otherwise the usable engine (then rank) with the most projected free room (capacity - projected
    KV - the session's expected size there), room within ``tie_fraction`` of the largest pool counting as a
    tie. Engines with no KV figures yet count as fully free.
    Ties (within ``tie_fraction``) go to the engine with the fewest running plus waiting requests first, then
    by fewest active sessions, then by the engine list order.
  - an engine that leaves the router's list, is marked unhealthy there or refuses a connection: its sessions are re-placed on
    their next call (counted in ``replaced``); a refused connection keeps the engine out for
    ``unreachable_s`` seconds.
  - reopened: a closed session's engine (and rank) is kept as a hint for ``reopen_hint_s`` seconds (at most
    ``max_sessions`` hints, the oldest dropped first). SGLang 0.5.17+ re-opens a closed id on its next request
    (SGLang's mem_cache/unified_cache/session_ref_tracker.py, ``ensure_session_generation``), and kvgate
    re-opens a session that comes back after an idle close; its prefix may still sit in that engine's radix
    cache (a closed session's KV is evictable, not gone), so the re-opened session goes back there while that
    rank is usable and below ``pressure_threshold``, before the prefix rule (whose index may point a shared
    prompt at a sibling's engine, or hold no key at all for a prompt that was rewritten or is under one block).
    At or above the threshold it is placed by the rules, unless no other usable rank is below the threshold
    either: then it goes back all the same (as for prefix).
  - a closed session is otherwise forgotten; at most ``max_sessions`` are kept (the longest idle dropped first).
  - dormant: a session the program policy found ended (idle far past what its gaps between turns predict) while
    it stays open (pausing off) counts in no projected KV and no session count until its next call; it stays
    sticky. The engine holds its KV, but evicts it after every closed session's, the longest idle first.
  - in flight: a call's prompt counts on its engine from the moment kvgate sends it until the engine's next
    KV figures that were requested after it went out (``set_capacity``'s ``taken_at``): SGLang's
    num_used_tokens / token_usage include the KV of every running request (SGLang's
    managers/scheduler_components/pool_stats_observer.py: used = max_total_num_tokens - (available + evictable)),
    so counting the prompt on top of those figures as well would count it twice, and a busy engine would
    look full for as long as its calls run. A call still in the engine's waiting queue at the scrape is
    in neither figure until its prefill runs (the engines do not report queued tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True, slots=True)
class Target:
    """Where one call goes: the engine base URL and the DP rank to pin (None: the engine has one rank)."""

    engine: str
    dp_rank: int | None = None


# Calls remembered per engine as ended, awaiting figures that may still count them (bounded without figures).
_MAX_ENDED = 10_000


@dataclass(slots=True)
class _Group:
    """Sessions whose prompts matched one indexed prompt (GRPO siblings over a task prompt), or one session alone.

    shared: tokens of the prompt they share (estimated at block granularity; 0 for a session alone).
    grown: the largest prompt + output any of them reached (tokens), live or ended: what each is expected to
    grow to. cells: (engine URL, rank) -> [live sessions there, sum of their largest sizes (tokens)].
    """

    shared: int
    grown: int = 0
    cells: dict[tuple[str, int], list[int]] = field(default_factory=dict)

    def kv(self, n: int, peaks: int) -> tuple[int, int]:
        """(held, growth) tokens of ``n`` live sessions on one rank whose largest sizes sum to ``peaks``: the
        shared prefix held once, and what they are expected to add to reach ``grown`` (module docstring)."""
        if n <= 0:
            return 0, 0
        return max(0, peaks - (n - 1) * self.shared), n * self.grown - peaks


@dataclass(slots=True)
class _Session:
    target: Target
    last_used: float
    group: _Group
    peak: int = 0  # the largest prompt + output seen (tokens): what the session holds
    by_router: bool = False  # the router picked the engine (learned from its answer), not kvgate
    moves: int = 0  # times admission moved it to another engine with room
    dormant: bool = False  # ended by admission's evidence while still open: counts nowhere until its next call


@dataclass
class _Engine:
    url: str
    order: int
    healthy: bool = True
    # One (capacity, used) per DP rank, engine-reported tokens; None = no figures yet.
    pools: list[tuple[int, int]] | None = None
    # rank (0 when single) -> prompt tokens of the calls in ``fresh``: those the figures cannot include yet
    in_flight: dict[int, int] = field(default_factory=dict)
    # call handle -> (sent at, rank, prompt tokens), oldest first; dropped once figures requested later arrive
    fresh: dict[int, tuple[float, int, int]] = field(default_factory=dict)
    # running + waiting requests the engine reported (all ranks; 0 until reported)
    reported_requests: int = 0
    # call handle -> sent at, for kvgate's calls the last figures include (sent before they were requested):
    # one that ends before the next figures runs there no more, so it comes off reported_requests
    counted: dict[int, float] = field(default_factory=dict)
    # call handle -> (sent at, ended at) of calls that ended lately: figures requested between the two count a
    # call that is gone by the time they arrive (a poll answered after the call's end); pruned as figures come
    ended: dict[int, tuple[float, float]] = field(default_factory=dict)
    sessions: dict[int, int] = field(default_factory=dict)   # rank -> active sessions
    unreachable_until: float = float("-inf")

    @property
    def dp_size(self) -> int:
        return len(self.pools) if self.pools else 1

    def rank_free(self, rank: int) -> int | None:
        if not self.pools or rank >= len(self.pools):
            return None
        cap, used = self.pools[rank]
        return cap - used - self.in_flight.get(rank, 0)

    def rank_usage(self, rank: int) -> float:
        if not self.pools or rank >= len(self.pools) or self.pools[rank][0] <= 0:
            return 0.0
        cap, used = self.pools[rank]
        return (used + self.in_flight.get(rank, 0)) / cap

    def free(self) -> int | None:
        if not self.pools:
            return None
        return sum(self.rank_free(r) or 0 for r in range(len(self.pools)))

    def n_sessions(self) -> int:
        return sum(self.sessions.values())

    def load(self) -> int:
        """Compute load: the engine's reported running + waiting requests, plus kvgate's calls sent since the
        figures were requested (the figures cannot include those yet)."""
        return self.reported_requests + len(self.fresh)


class Placement:
    """Session -> engine placement (see the module docstring for the rules).

    pressure_threshold: share of a rank's capacity, in (0, 1], that its projected KV with a new session must stay
    under for the prefix's engine to take the session as of right; KV usage at or above which a closed
    session's engine takes it back only if no other rank is below it.
    tie_fraction: free-KV differences below this share of the largest pool count as ties, in [0, 1).
    unreachable_s: seconds an engine that refused a connection stays out.
    max_sessions / max_prefixes: caps on remembered sessions and indexed prompts (oldest dropped first); the
    closed sessions' engine hints are capped at max_sessions too, the prompt groups' histories at max_prefixes.
    reopen_hint_s: seconds a closed session's engine is kept as a hint for its re-opening (0: no hint).
    busier_margin: requests (running + waiting) by which a prefix's engine may exceed the least busy other
    usable engine and still take a new session sharing that prefix; None: load never moves it.
    session_growth: count the KV kvgate's live sessions hold and are expected to grow to, and the new session's
    own expected size ("projected KV" in the module docstring); False: the engines' reported usage plus the
    calls in flight alone, the new session counting as nothing until it is sent.
    Raises ValueError for a value out of range.
    """

    def __init__(self, *, pressure_threshold: float = 0.85, tie_fraction: float = 0.02, unreachable_s: float = 5.0,
                 max_sessions: int = 100_000, max_prefixes: int = 100_000, reopen_hint_s: float = 600.0,
                 busier_margin: int | None = 4, session_growth: bool = True):
        if not 0 < pressure_threshold <= 1 or not 0 <= tie_fraction < 1 or max_sessions < 1 or max_prefixes < 1 \
                or not reopen_hint_s >= 0 or busier_margin is not None and busier_margin < 0:
            raise ValueError("pressure_threshold in (0, 1], tie_fraction in [0, 1), caps >= 1, reopen_hint_s >= 0, "
                             "busier_margin >= 0 or None")
        self.busier_margin = busier_margin
        self.session_growth = session_growth
        self.pressure_threshold = pressure_threshold
        self.tie_fraction = tie_fraction
        self.unreachable_s = unreachable_s
        self.max_sessions = max_sessions
        self.max_prefixes = max_prefixes
        self.reopen_hint_s = reopen_hint_s
        self._engines: dict[str, _Engine] = {}
        self._targets: dict[tuple[str, int | None], Target] = {}
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # first = longest idle
        self._prefixes: OrderedDict[int, Target] = OrderedDict()    # prompt chain key -> where it went
        self._closed: OrderedDict[str, tuple[Target, float]] = OrderedDict()  # closed session -> (target, closed at)
        self._groups: OrderedDict[int, _Group] = OrderedDict()  # prompt chain key -> its sessions' group
        # (engine URL, rank) -> [live sessions, held tokens, expected growth tokens]: the running sums of the
        # groups' cells there (module docstring, "projected KV"); an entry goes when its last session does
        self._kv: dict[tuple[str, int], list[int]] = {}
        self._calls = 0  # the last call handle given out
        self.placements: dict[str, int] = {}  # engine -> sessions placed there (new and re-placed)
        # why the last place() chose its target: sticky | reopened | prefix | free_kv
        self.last_reason: str | None = None
        self.last_replaced = False           # the last place() moved a session off an engine it cannot use
        # reopen_elsewhere: a fresh reopen hint whose session went to another engine; pressed_stay: a reopened
        # or prefix placement kept on a rank at the threshold because every usable rank was
        self.counts = {"sticky": 0, "reopened": 0, "prefix": 0, "free_kv": 0, "replaced": 0, "no_engine": 0,
                       "unreachable": 0, "dropped": 0, "adopted": 0, "reopen_elsewhere": 0, "pressed_stay": 0,
                       "routed": 0, "busier_moved": 0, "moved": 0, "kv_moved": 0}

    # --- the fleet ---------------------------------------------------------------------------------

    def set_engines(self, engines: Iterable[tuple[str, bool]]) -> None:
        """The current engine list as (base URL, healthy) pairs, in the router's order. Engines not in
        it are dropped (their sessions are re-placed on their next call)."""
        new: dict[str, _Engine] = {}
        for i, (url, healthy) in enumerate(engines):
            e = self._engines.get(url) or _Engine(url, i)
            e.order, e.healthy = i, bool(healthy)
            new[url] = e
        self._engines = new
        for e in new.values():
            e.sessions = {}
        for s in self._sessions.values():  # an engine that left and came back gets its sessions counted again
            if not s.dormant:
                self._count_session(s.target, +1)

    def set_capacity(self, pools: Mapping[str, Sequence[tuple[int, ...]]], taken_at: float | None = None) -> None:
        """Engine-reported KV figures: engine URL -> one (max_total_num_tokens, num_used_tokens[, running +
        waiting requests]) per DP rank, requested at ``taken_at`` (the clock of ``now``, seconds; None: unknown). Calls sent at or before
        ``taken_at`` stop counting as in flight on those engines: the figures include their KV once the engine
        runs them. An engine missing here keeps its last figures (a failed scrape is not a dead engine: health
        comes from the router's list and from refused connections)."""
        for url, p in pools.items():
            e = self._engines.get(url)
            if e is not None and p:
                e.pools = [(int(f[0]), int(f[1])) for f in p]
                e.reported_requests = sum(int(f[2]) for f in p if len(f) > 2)
                e.counted.clear()
                if taken_at is None:
                    e.ended.clear()
                else:
                    while e.fresh:
                        handle, (sent, rank, tokens) = next(iter(e.fresh.items()))
                        if sent > taken_at:
                            break
                        del e.fresh[handle]
                        e.counted[handle] = sent
                        e.in_flight[rank] = e.in_flight.get(rank, 0) - tokens
                    gone = sum(1 for sent, end in e.ended.values() if sent <= taken_at < end)
                    e.reported_requests = max(0, e.reported_requests - gone)
                    e.ended = {h: se for h, se in e.ended.items() if se[1] > taken_at}

    def mark_unreachable(self, engine: str, now: float) -> None:
        """A connection to ``engine`` was refused before any byte went out: keep it out for a while."""
        e = self._engines.get(engine)
        if e is not None:
            e.unreachable_until = now + self.unreachable_s
            self.counts["unreachable"] += 1

    def _usable(self, e: _Engine, now: float) -> bool:
        return e.healthy and now >= e.unreachable_until

    # --- placing -----------------------------------------------------------------------------------

    def place(self, session_id: str, prefix_keys: Sequence[int], now: float,
              exclude: Iterable[str] = (), prompt_tokens: int = 0) -> Target | None:
        """Where ``session_id``'s next call goes, or None when no engine is usable (forward to the router).

        prefix_keys: chain hashes of the call's prompt after 1, 2, ... full blocks (may be empty).
        exclude: engines already tried for this call. prompt_tokens: the call's prompt size (tokens, an
        estimate; 0: unknown), for the session's expected KV. Records the placement (sticky from now on).
        """
        excluded = set(exclude)
        self.last_reason, self.last_replaced = None, False
        s = self._sessions.get(session_id)
        if s is not None:
            e = self._engines.get(s.target.engine)
            if e is not None and e.url not in excluded and self._usable(e, now):
                self._sessions.move_to_end(session_id)
                s.last_used = now
                self._wake(s)
                rank = s.target.dp_rank
                if (rank is None and e.dp_size > 1) or (rank is not None and rank >= e.dp_size):
                    # ranks became known after the first call (or the engine came back with fewer)
                    self._set_target(session_id, s, self._target(e.url, self._best_rank(e) if e.dp_size > 1 else None))
                self.counts["sticky"] += 1
                self.last_reason = "sticky"
                s.by_router = False
                return s.target
            self.counts["replaced"] += 1
            self.last_replaced = True
        target, reason, hint = None, None, None
        if s is None:
            target, hint = self._reopen_target(session_id, now, excluded)
            reason = "reopened" if target is not None else None
        prompt_tokens = max(0, int(prompt_tokens))
        if s is None:
            key, group, shared = self._group_of(prefix_keys, prompt_tokens)
            expect = max(prompt_tokens, group.grown if group is not None else 0)
        else:  # re-placed: it takes everything it holds and will grow to
            key, group, shared = None, s.group, s.group.shared
            expect = max(prompt_tokens, s.peak, s.group.grown)
        if not self.session_growth:
            expect = 0
        if target is None:
            target, reason = self._choose(prefix_keys, now, excluded, group, expect)
        if hint is not None and (target is None or target.engine != hint):
            self.counts["reopen_elsewhere"] += 1
        if target is None:
            self.counts["no_engine"] += 1
            return None
        self.counts[reason] += 1
        self.last_reason = reason
        self.placements[target.engine] = self.placements.get(target.engine, 0) + 1
        if s is None:
            if group is None:
                group = _Group(shared)
                if key is not None:
                    self._groups[key] = group
                    while len(self._groups) > self.max_prefixes:
                        self._groups.popitem(last=False)  # its live sessions keep it; only its lookup goes
            s = self._add_session(session_id, _Session(target, now, group))
            self._grow(s, prompt_tokens)
        else:
            self._sessions.move_to_end(session_id)
            s.last_used = now
            s.by_router = False
            self._set_target(session_id, s, target)
            self._grow(s, prompt_tokens)
        return target

    def _group_of(self, prefix_keys: Sequence[int], prompt_tokens: int) -> tuple[int | None, _Group | None, int]:
        """(key, group, shared tokens) for a new session: the group of the longest indexed prompt its prompt
        extends, else of its own prompt's key (siblings whose index entry was dropped), else None (key and
        shared: what a new group would take). Shared tokens are the prompt's share up to the matched block."""
        if not prefix_keys:
            return None, None, 0
        n = len(prefix_keys)
        for i in range(n - 1, -1, -1):
            key = prefix_keys[i]
            if key in self._prefixes or key in self._groups:
                break
        else:
            i, key = n - 1, prefix_keys[-1]
        group = self._groups.get(key)
        if group is not None:
            self._groups.move_to_end(key)
            return key, group, group.shared
        return key, None, prompt_tokens * (i + 1) // n

    def _reopen_target(self, session_id: str, now: float, excluded: set) -> tuple[Target | None, str | None]:
        """(target, hinted engine): the engine (rank) a closed ``session_id`` was on, if its hint is fresh and
        that rank is usable and below the pressure threshold (or every usable rank is at it); else (None, the
        hinted engine, or None without a fresh hint). The hint is used up either way."""
        hint = self._closed.pop(session_id, None)
        if hint is None:
            return None, None
        t, closed_at = hint
        if now - closed_at > self.reopen_hint_s:
            return None, None  # stale: its prefix is likely evicted by now
        e = self._engines.get(t.engine)
        if e is None or e.url in excluded or not self._usable(e, now):
            return None, t.engine
        rank = t.dp_rank if e.dp_size > 1 else None
        if rank is not None and rank >= e.dp_size or rank is None and e.dp_size > 1:
            rank = self._best_rank(e)  # the engine came back with fewer ranks, or its ranks became known
        if e.rank_usage(rank or 0) >= self.pressure_threshold:
            if self._room_elsewhere(e, rank or 0, now, excluded):
                return None, t.engine
            self.counts["pressed_stay"] += 1
        return Target(e.url, rank), t.engine

    def _room_elsewhere(self, home: _Engine, home_rank: int, now: float, excluded: set,
                        usable: Sequence[_Engine] | None = None) -> bool:
        """Whether a usable rank other than ``home``'s ``home_rank`` is below the pressure threshold: only
        then does pressure move a session off the rank that holds its prefix (an engine with no figures yet
        counts as free)."""
        if usable is None:
            usable = [e for e in self._engines.values() if e.url not in excluded and self._usable(e, now)]
        th = self.pressure_threshold
        return any(o.rank_usage(r) < th for o in usable for r in range(o.dp_size)
                   if not (o is home and r == home_rank))

    def _set_target(self, session_id: str, s: _Session, target: Target) -> None:
        self._wake(s)
        self._counted(s, -1)
        s.target = target
        self._counted(s, +1)

    def _counted(self, s: _Session, sign: int) -> None:
        """Count ``s`` on its target (``sign`` +1) or take it off (-1): its session count and its KV."""
        self._count_session(s.target, sign)
        self._cell(s.group, s.target, sign, sign * s.peak)

    def _add_session(self, session_id: str, s: _Session) -> _Session:
        """Record a new session (its count and KV on its target), dropping the longest idle over the cap."""
        self._sessions[session_id] = s
        self._counted(s, +1)
        self._evict_over_cap()
        return s

    def _drop_session(self, s: _Session) -> None:
        """A session gone (forgotten or dropped): its count and KV stop counting; its group's ``grown`` stays."""
        if not s.dormant:
            self._counted(s, -1)

    def _wake(self, s: _Session) -> None:
        """A dormant session is back (a call, a move): its count and KV count on its engine again."""
        if s.dormant:
            s.dormant = False
            self._counted(s, +1)

    def dormant(self, session_id: str) -> bool:
        """Admission found ``session_id`` ended (idle far past what its own and its group's gaps between turns
        predict) while its session stays open: its count and KV stop counting on its engine (the engine evicts
        an open session's KV after every closed one's, the longest idle first), and it stays sticky there. Its
        next call, or a move, counts it again. Returns whether it was counted until now."""
        s = self._sessions.get(session_id)
        if s is None or s.dormant:
            return False
        self._counted(s, -1)
        s.dormant = True
        return True

    def _cell(self, g: _Group, t: Target, dn: int, dpeaks: int) -> None:
        """Change ``g``'s cell on ``t``'s rank by ``dn`` live sessions and ``dpeaks`` tokens of largest sizes,
        and that rank's running sums by the change of the cell's (held, growth): O(1)."""
        key = (t.engine, t.dp_rank or 0)
        cell = g.cells.get(key) or [0, 0]
        h0, r0 = g.kv(*cell)
        cell[0] += dn
        cell[1] += dpeaks
        h1, r1 = g.kv(*cell)
        sums = self._kv.get(key) or [0, 0, 0]
        sums[0] += dn
        sums[1] += h1 - h0
        sums[2] += r1 - r0
        if cell[0] > 0:
            g.cells[key] = cell
        else:
            g.cells.pop(key, None)
        if sums[0] > 0:
            self._kv[key] = sums
        else:
            self._kv.pop(key, None)

    def _grow(self, s: _Session, tokens: int) -> None:
        """``s`` was seen at ``tokens`` (prompt, or prompt + output): raise its largest size, and its group's
        ``grown`` (every live sibling is then expected to grow that far: O(ranks the group is on))."""
        if tokens <= s.peak:
            return
        self._wake(s)
        self._cell(s.group, s.target, 0, tokens - s.peak)
        s.peak = tokens
        g = s.group
        if tokens > g.grown:
            for key, (n, _) in g.cells.items():
                self._kv[key][2] += n * (tokens - g.grown)
            g.grown = tokens

    def _count_session(self, t: Target, delta: int) -> None:
        e = self._engines.get(t.engine)
        if e is not None:
            r = t.dp_rank or 0
            e.sessions[r] = max(0, e.sessions.get(r, 0) + delta)

    def _target(self, url: str, rank: int | None) -> Target:
        """The one Target for (url, rank): sessions and indexed prompts share it instead of holding a copy each."""
        t = self._targets.get((url, rank))
        if t is None:
            t = self._targets[(url, rank)] = Target(url, rank)
        return t

    def _choose(self, prefix_keys: Sequence[int], now: float, excluded: set, group: _Group | None = None,
                expect: int = 0) -> tuple[Target | None, str]:
        """The prefix or free-KV rule's target for a session of ``group`` (None: a group of its own) expected
        to hold ``expect`` tokens, and the rule's name; (None, "no_engine") when no engine is usable."""
        usable = [e for e in self._engines.values() if e.url not in excluded and self._usable(e, now)]
        if not usable:
            return None, "no_engine"
        for key in reversed(prefix_keys):
            t = self._prefixes.get(key)
            if t is None:
                continue
            e = self._engines.get(t.engine)
            if e is not None and e in usable:
                rank = t.dp_rank if e.dp_size > 1 else None
                if rank is not None and rank >= e.dp_size:
                    rank = self._best_rank(e)
                if self.busier_margin is not None and self._busier(e, usable, self.busier_margin):
                    self.counts["busier_moved"] += 1
                    break
                r = rank or 0
                room = self._room(e, r, self._expected_on(e, r, group, expect))
                if room is None or self._fits(e, r, room):
                    return self._target(e.url, rank), "prefix"
                if not self._better_elsewhere(e, r, room, usable, now, excluded, group, expect):
                    self.counts["pressed_stay"] += 1
                    return self._target(e.url, rank), "prefix"
                self.counts["kv_moved"] += 1
            break  # the longest known prefix sits on a busy, full or gone engine: place by free KV
        unit = self._tie_unit(usable)
        e = min(usable, key=lambda x: self._engine_key(x, unit, group, expect))
        return self._target(e.url, self._best_rank(e, group, expect) if e.dp_size > 1 else None), "free_kv"

    def _better_elsewhere(self, home: _Engine, r: int, room: int, usable: Sequence[_Engine], now: float,
                          excluded: set, group: _Group | None, expect: int) -> bool:
        """Whether a session whose prefix's rank (``home``'s ``r``) would be left with ``room`` projected free
        tokens should go elsewhere: some other usable rank would have more room after taking it and
        re-prefilling the prefix (an engine with no figures yet counts as free); with ``session_growth`` off,
        some other usable rank is below the pressure threshold."""
        if not self.session_growth:
            return self._room_elsewhere(home, r, now, excluded, usable)
        return any((other := self._room(o, q, self._expected_on(o, q, group, expect))) is None or other > room
                   for o in usable for q in range(o.dp_size) if not (o is home and q == r))

    def _projected(self, e: _Engine, rank: int) -> int:
        """Projected KV tokens of ``e``'s ``rank``: max(reported used + in flight, held) + expected growth."""
        sums = self._kv.get((e.url, rank)) if self.session_growth else None
        held, growth = (sums[1], sums[2]) if sums else (0, 0)
        if e.pools and rank < len(e.pools):
            held = max(held, e.pools[rank][1] + e.in_flight.get(rank, 0))
        return held + growth

    def _expected_on(self, e: _Engine, rank: int | None, group: _Group | None, expect: int) -> int:
        """Tokens a session of ``group`` expected to hold ``expect`` adds on ``e``'s ``rank`` (None: any rank):
        less the shared prefix where live sessions of its group hold it, all of it elsewhere (the re-prefill)."""
        if group is None or not group.cells:
            return expect
        ranks = range(e.dp_size) if rank is None else (rank,)
        if any((e.url, r) in group.cells for r in ranks):
            return max(0, expect - group.shared)
        return expect

    def _room(self, e: _Engine, rank: int, adds: int) -> int | None:
        """Projected free tokens of ``e``'s ``rank`` once it takes ``adds`` more; None without figures."""
        if not e.pools or rank >= len(e.pools):
            return None
        return e.pools[rank][0] - self._projected(e, rank) - adds

    def _fits(self, e: _Engine, rank: int, room: int) -> bool:
        """Whether the rank's projected KV (capacity - ``room``) stays under pressure_threshold x capacity."""
        cap = e.pools[rank][0]
        return cap <= 0 or cap - room < self.pressure_threshold * cap

    @staticmethod
    def _busier(e: _Engine, usable: Sequence[_Engine], margin: int) -> bool:
        """Whether ``e`` has more than ``margin`` running + waiting requests over the least busy other usable
        engine."""
        others = [o.load() for o in usable if o is not e]
        return bool(others) and e.load() > min(others) + margin

    def _tie_unit(self, engines: Sequence[_Engine]) -> int:
        largest = max((c for e in engines for c, _ in (e.pools or [])), default=0)
        return max(1, int(largest * self.tie_fraction))

    def _engine_key(self, e: _Engine, unit: int, group: _Group | None, expect: int) -> tuple:
        if not e.pools:  # no figures yet: count as fully free (an engine that just joined is as good as an idle one)
            free_q = float("inf")
        else:
            room = sum(c - self._projected(e, r) for r, (c, _) in enumerate(e.pools))
            free_q = (room - self._expected_on(e, None, group, expect)) // unit
        return (-free_q, e.load(), e.n_sessions(), e.order)

    def _best_rank(self, e: _Engine, group: _Group | None = None, expect: int = 0) -> int:
        unit = self._tie_unit([e])
        return min(range(e.dp_size), key=lambda r: (
            -((self._room(e, r, self._expected_on(e, r, group, expect)) or 0) // unit), e.sessions.get(r, 0), r))

    # --- per-call accounting -------------------------------------------------------------------------

    def remember_prefix(self, prefix_keys: Sequence[int], target: Target) -> None:
        """Index a placed call's prompt (its longest full-block key) as living on ``target``."""
        if not prefix_keys:
            return
        key = prefix_keys[-1]
        self._prefixes[key] = target
        self._prefixes.move_to_end(key)
        while len(self._prefixes) > self.max_prefixes:
            self._prefixes.popitem(last=False)

    def call_started(self, target: Target, prompt_tokens: int, now: float, session_id: str | None = None) -> int:
        """A call with ``prompt_tokens`` (an estimate, tokens) went to ``target`` at ``now``: it counts there until
        it ends or the engine's figures include it (:meth:`set_capacity`), and as ``session_id``'s size (when
        given and known) from now on. Returns the call's handle for :meth:`call_finished`."""
        if session_id is not None:
            self.observed(session_id, prompt_tokens)
        self._calls += 1
        e = self._engines.get(target.engine)
        if e is not None:
            r = target.dp_rank or 0
            tokens = max(0, int(prompt_tokens))
            e.fresh[self._calls] = (now, r, tokens)
            e.in_flight[r] = e.in_flight.get(r, 0) + tokens
        return self._calls

    def call_finished(self, target: Target, handle: int, now: float | None = None) -> None:
        """The call :meth:`call_started` returned ``handle`` for ended (any outcome) at ``now`` (seconds, the
        clock of ``call_started``). Figures that counted it running stop counting it: the last ones at once, and
        those requested before ``now`` that arrive later (given ``now``)."""
        e = self._engines.get(target.engine)
        if e is None:
            return
        call = e.fresh.pop(handle, None)
        if call is not None:
            e.in_flight[call[1]] = e.in_flight.get(call[1], 0) - call[2]
            sent = call[0]
        else:
            sent = e.counted.pop(handle, None)
            if sent is not None:  # the last figures counted it running; it no longer is
                e.reported_requests = max(0, e.reported_requests - 1)
        if now is not None and sent is not None:
            e.ended[handle] = (sent, now)
            if len(e.ended) > _MAX_ENDED:  # no figures for a long while: forget the oldest
                del e.ended[next(iter(e.ended))]

    def observed(self, session_id: str, tokens: int) -> None:
        """``session_id``'s call held ``tokens`` (prompt + output as the engine reported them, or the prompt sent):
        the session holds at least that much KV from now on, and its group's sessions are expected to grow that
        far (module docstring, "projected KV"). Ignored for an unknown session."""
        s = self._sessions.get(session_id)
        if s is not None:
            self._grow(s, max(0, int(tokens)))

    def adopt(self, session_id: str, target: Target, now: float) -> bool:
        """Another kvgate replica placed ``session_id`` on ``target``: make it this session's sticky target
        here, when that engine is known and usable (else the session is placed by the rules). Returns
        whether it was adopted."""
        e = self._engines.get(target.engine)
        if e is None or not self._usable(e, now):
            return False
        self._closed.pop(session_id, None)
        s = self._sessions.get(session_id)
        if s is None:
            self._add_session(session_id, _Session(target, now, _Group(0)))
        else:
            self._set_target(session_id, s, target)
        self.counts["adopted"] += 1
        return True

    def move(self, session_id: str, target: Target, now: float) -> Target | None:
        """Admission found no room for ``session_id``'s waiting call on its engine and room on ``target``: the
        session goes there from now on (sticky), its move counted (``moves_of``). Returns the target, or None
        when that engine is not known or not usable (nothing changes)."""
        e = self._engines.get(target.engine)
        if e is None or not self._usable(e, now):
            return None
        target = self._target(target.engine, target.dp_rank if e.dp_size > 1 else None)
        self._closed.pop(session_id, None)
        s = self._sessions.get(session_id)
        if s is None:
            s = self._add_session(session_id, _Session(target, now, _Group(0)))
        elif s.target != target:
            self._set_target(session_id, s, target)
        else:
            return target
        s.by_router = False
        s.moves += 1
        self.counts["moved"] += 1
        self.placements[target.engine] = self.placements.get(target.engine, 0) + 1
        return target

    def moves_of(self, session_id: str) -> int:
        """Times admission moved ``session_id`` to another engine with room (0 when unknown)."""
        s = self._sessions.get(session_id)
        return 0 if s is None else s.moves

    def learn(self, session_id: str, target: Target, now: float) -> bool:
        """The router sent ``session_id``'s call to ``target`` (smg 1.13 names the worker in its answer's
        x-smg-routed-worker-id): record it as the session's engine, the sticky target should kvgate place the
        session later and the engine admission counts its later turns on. Ignored for an engine not in the list.
        Returns whether the session's engine changed (a new session, or the router moved it)."""
        if target.engine not in self._engines:
            return False
        target = self._target(target.engine, target.dp_rank)
        self._closed.pop(session_id, None)
        s = self._sessions.get(session_id)
        if s is None:
            s = self._add_session(session_id, _Session(target, now, _Group(0), by_router=True))
        else:
            self._sessions.move_to_end(session_id)
            s.last_used = now
            self._wake(s)
            if s.target == target:
                return False
            self._set_target(session_id, s, target)
            s.by_router = True
        self.counts["routed"] += 1
        return True

    def placed_by(self, session_id: str) -> str | None:
        """Who picked ``session_id``'s engine: "kvgate", "router" (learned from its answer), or None."""
        s = self._sessions.get(session_id)
        return None if s is None else ("router" if s.by_router else "kvgate")

    def forget(self, session_id: str, now: float | None = None) -> bool:
        """The session closed at ``now`` (monotonic seconds): drop it, keeping its engine as the hint for a
        re-opening (module docstring) when ``now`` is given and ``reopen_hint_s`` > 0. Returns whether it
        was known."""
        s = self._sessions.pop(session_id, None)
        if s is None:
            return False
        self._drop_session(s)
        if now is not None and self.reopen_hint_s > 0:
            self._closed[session_id] = (s.target, now)
            self._closed.move_to_end(session_id)
            while len(self._closed) > self.max_sessions:
                self._closed.popitem(last=False)
        return True

    def reopen_hints(self, now: float) -> int:
        """Closed sessions whose engine hint is still fresh at ``now`` (for /kvgate/engines)."""
        while self._closed:
            sid, (_, closed_at) = next(iter(self._closed.items()))
            if now - closed_at <= self.reopen_hint_s:
                break
            del self._closed[sid]  # oldest first: the rest are fresher
        return len(self._closed)

    def _evict_over_cap(self) -> None:
        while len(self._sessions) > self.max_sessions:
            _, s = self._sessions.popitem(last=False)
            self._drop_session(s)
            self.counts["dropped"] += 1

    # --- the read interface --------------------------------------------------------------------------

    def engine_of(self, session_id: str) -> tuple[str, int | None] | None:
        """(engine base URL, DP rank or None) a session is on, placed by kvgate or learned from the router's
        answer (learn()), or None when neither is known."""
        s = self._sessions.get(session_id)
        return None if s is None else (s.target.engine, s.target.dp_rank)

    def sessions_on(self, engine: str) -> int:
        """Active sessions placed on ``engine`` (all DP ranks)."""
        e = self._engines.get(engine)
        return e.n_sessions() if e is not None else 0

    def __len__(self) -> int:
        return len(self._sessions)

    def as_json(self) -> dict:
        """Per-engine figures for /kvgate/engines: sessions, placements, in-flight prompt tokens, free KV, and the
        projected KV (tokens, summed over DP ranks) with its parts kvgate keeps: the KV its live sessions hold
        and their expected growth."""
        def kv(url: str, part: int) -> int:
            return sum(v[part] for (u, _), v in self._kv.items() if u == url)
        return {url: {"sessions": e.n_sessions(), "sessions_by_rank": {str(r): n for r, n in sorted(e.sessions.items())},
                      "placements": self.placements.get(url, 0), "in_flight_prompt_tokens": sum(e.in_flight.values()),
                      "free_tokens": e.free(), "requests": e.load(), "dp_size": e.dp_size, "usable": e.healthy,
                      "held_tokens": kv(url, 1), "expected_growth_tokens": kv(url, 2),
                      "projected_tokens": sum(self._projected(e, r) for r in range(e.dp_size))}
                for url, e in self._engines.items()}


def placement_active(mode: str, features_on: bool) -> bool:
    """Whether kvgate places a route's session traffic: ``kvgate`` always, ``router`` never, ``auto`` when
    session lifecycle or admission is on (whatever the router does with session_id: kvgate then keeps each
    session on one engine, admission knows that engine, and the router's hop is saved; docs/placement.md)."""
    return mode == "kvgate" or (mode == "auto" and features_on)
