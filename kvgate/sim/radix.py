"""Token-level radix prefix cache over a fixed KV token pool (pure, no I/O).

Follows SGLang srt/mem_cache/radix_cache.py (page_size 1, compressed edges, lock_ref,
leaf-only eviction, evictable/protected accounting) plus the two session-radix-cache
behaviours docs/simulator-fidelity.md describes ("Sessions"):

* ``"0.5.17"``: per-session references on the nodes a session's requests inserted or
  walked through; eviction key is ``(has_refs, ref_count, base_key)`` so unreferenced
  entries go first; close only drops the references and tombstones the id (max 8192).
* ``"0.5.15"``: nodes are tagged with the sessions that went through them; close
  bulk-frees the session's leaf chains at once unless locked, shared or with children.
  Requires ``eviction_policy == "priority"`` (``SessionConfigError`` otherwise).
* ``"off"``: ``enable_session_radix_cache`` disabled, session ids are ignored for caching.

Pool accounting (all in tokens):
``available = max_total - tree_tokens - private``, ``evictable`` = tree tokens in nodes with
``lock_ref == 0``, so ``num_used = max_total - (available + evictable)`` = locked tree tokens
+ tokens privately held by running requests, exactly the SGLang identity.

Access "time" is a logical counter (strictly increasing per access), which makes LRU order
deterministic; SGLang uses time.monotonic() for the same purpose.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

SESSION_MODES = ("0.5.17", "0.5.15", "off")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
EVICTION_POLICIES = ("lru", "priority")
TOMBSTONE_MAX = 8192


class SessionConfigError(ValueError):
    """Raised when the session semantics and eviction policy are incompatible (SGLang startup check)."""


class OutOfTokens(RuntimeError):
    """Raised by :meth:`RadixCache.alloc` when the pool cannot supply the tokens even after evicting."""


class TreeNode:
    """One radix node: ``key`` is the token-id tuple on the edge into this node (its KV length)."""

    __slots__ = ("key", "children", "parent", "lock_ref", "last_access", "priority",
                 "sessions", "untagged", "id", "hits")

    _next_id = 0

    def __init__(self, key: tuple = (), parent: Optional["TreeNode"] = None):
        self.key = key
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.priority = 0
        # session id -> number of inserts through this node (0.5.17 refs / 0.5.15 tags)
        self.sessions: dict[str, int] = {}
        self.untagged = False  # used by a request without a (tracked) session (0.5.15 "shared")
        self.hits = 0          # inserts through this node (HiCache write_through_selective)
        TreeNode._next_id += 1
        self.id = TreeNode._next_id

    def __repr__(self) -> str:  # pragma: no cover - debug aid
        return f"TreeNode(len={len(self.key)}, lock={self.lock_ref}, refs={self.sessions})"


@dataclass
class MatchResult:
    """Result of :meth:`RadixCache.match_prefix`: cached prefix ``length`` (tokens) and its ``node``."""

    length: int
    node: TreeNode


class RadixCache:
    """Radix prefix cache + KV token pool of ``max_total_tokens`` slots.

    Args: ``max_total_tokens`` (pool size, tokens), ``session_mode`` one of ``SESSION_MODES``,
    ``eviction_policy`` ``"lru"`` or ``"priority"`` (key ``(priority, last_access)``).
    Raises ``SessionConfigError`` for ``session_mode="0.5.15"`` without ``priority`` (as SGLang
    0.5.15-0.5.16 refuse to start) and ``ValueError`` for unknown modes.
    """

    def __init__(self, max_total_tokens: int, session_mode: str = "0.5.17",
                 eviction_policy: str = "lru"):
        if session_mode not in SESSION_MODES:
            raise ValueError(f"unknown session_mode {session_mode!r}")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction_policy {eviction_policy!r}")
        if session_mode == "0.5.15" and eviction_policy != "priority":
            raise SessionConfigError(
                "--enable-session-radix-cache requires --radix-eviction-policy priority")
        if max_total_tokens <= 0:
            raise ValueError("max_total_tokens must be positive")
        self.max_total = int(max_total_tokens)
        self.session_mode = session_mode
        self.eviction_policy = eviction_policy
        self._tick = 0
        self.host: Optional[RadixCache] = None
        self.host_write_policy = "write_through"
        self.backup_tokens_total = 0
        self.reset()

    # ------------------------------------------------------------------ host tier (HiCache)
    def attach_host(self, capacity_tokens: int, write_policy: str = "write_through") -> None:
        """Give this device cache a host-memory tier of ``capacity_tokens`` (SGLang HiRadixCache,
        ``--enable-hierarchical-cache``). ``write_through``: every KV inserted into the device tree is
        backed up to host at once; ``write_through_selective``: once a node was inserted twice (SGLang's
        write_through_threshold 2 vs 1, unified_radix_cache.py); ``write_back``: only when the device tree
        evicts it (mem_cache/hiradix_cache.py write_backup / evict). The host tier is a second radix tree over
        the same token keys, evicted by the same policy (evict_host: leaves by the eviction key).
        Raises ValueError for an unknown policy or a non-positive capacity."""
        if write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(f"hicache write policy must be one of {HICACHE_WRITE_POLICIES}")
        if capacity_tokens <= 0:
            raise ValueError("host capacity must be positive")
        self.host = RadixCache(capacity_tokens, "off", self.eviction_policy)
        self.host_write_policy = write_policy

    def host_match(self, ids: Sequence[int]) -> int:
        """Longest prefix of ``ids`` held by the host tier (tokens; 0 without one). Refreshes its LRU."""
        if self.host is None:
            return 0
        return self.host.match_prefix(ids).length

    def _backup(self, ids: Sequence[int], priority: int = 0) -> int:
        """Copy ``ids``' KV to the host tier, evicting host leaves to make room; returns tokens written.
        A sequence longer than the whole host pool is not backed up."""
        h = self.host
        new = len(ids) - h.cached_len(ids)
        if new <= 0:
            h.match_prefix(ids)
            return 0
        if new > h.max_total:
            return 0
        if h.available < new:
            h.evict(new - h.available)
        if h.available < new:   # pragma: no cover - the host tree holds no locks
            return 0
        h.insert(ids, priority=priority)
        self.backup_tokens_total += new
        return new

    def _path_ids(self, node: TreeNode) -> tuple:
        parts = []
        while node is not None and node is not self.root:
            parts.append(node.key)
            node = node.parent
        return tuple(t for key in reversed(parts) for t in key)

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Drop the whole tree (flush_cache). Private allocations are kept. Counters are kept."""
        self.root = TreeNode()
        self.root.lock_ref = 1  # root is never evicted
        self.tree_tokens = 0
        self.evictable = 0
        if not hasattr(self, "private"):
            self.private = 0
            self.evicted_total = 0
            self.session_freed_total = 0
            self.closed: OrderedDict[str, None] = OrderedDict()
            self.closes_received = 0
            # session id -> generation of its current opening (session_ref_tracker.py)
            self.generations: dict[str, int] = {}
            self._incarnations = 0
        # session id -> set of nodes carrying it
        self._session_nodes: dict[str, set[TreeNode]] = {}
        if getattr(self, "host", None) is not None:
            self.host.reset()   # flush_cache drops the host tier too (HiRadixCache.reset)

    @property
    def available(self) -> int:
        """Free pool slots (tokens)."""
        return self.max_total - self.tree_tokens - self.private

    @property
    def protected(self) -> int:
        """Tree tokens in locked nodes."""
        return self.tree_tokens - self.evictable

    @property
    def num_used(self) -> int:
        """``max_total - (available + evictable)`` (tokens), the SGLang num_used_tokens."""
        return self.max_total - (self.available + self.evictable)

    def _touch(self) -> int:
        self._tick += 1
        return self._tick

    def tracks_sessions(self, session_id: Optional[str], generation: Optional[int] = None) -> bool:
        """Whether ``session_id`` affects caching in this mode (False for None / "off" / tombstoned).

        0.5.17: a request carries the ``generation`` its session had when it was admitted; only the
        current generation of an open session tags (session_ref_tracker.py register_session_ref:
        "called for stale request; Skip it"). ``generation=None`` means "the current one"."""
        if not session_id or self.session_mode == "off":
            return False
        if self.session_mode != "0.5.17":
            return True
        if session_id in self.closed:
            return False
        return generation is None or self.generations.get(session_id) == generation

    def ensure_session_generation(self, session_id: Optional[str]) -> Optional[int]:
        """Generation of ``session_id`` for a NEW request, opening (or re-opening) it when needed.

        SGLang 0.5.17+ mem_cache/unified_cache/session_ref_tracker.py ensure_session_generation ->
        open_radix_session (called by scheduler.py for every request with a session_id): a closed id
        re-opens on a new request (tombstone cleared, a new generation). None without a session or
        outside 0.5.17 semantics."""
        if not session_id or self.session_mode != "0.5.17":
            return None
        gen = self.generations.get(session_id)
        if gen is None:
            self.closed.pop(session_id, None)
            self._incarnations += 1
            gen = self.generations[session_id] = self._incarnations
        return gen

    # ------------------------------------------------------------------ match
    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``ids`` (tokens). Splits a partially matched edge (as SGLang
        _split_node) and refreshes last-access on every node of the path (LRU)."""
        node = self.root
        t = self._touch()
        node.last_access = t
        pos = 0
        n = len(ids)
        while pos < n:
            child = node.children.get(ids[pos])
            if child is None:
                break
            key = child.key
            k = _common_len(key, ids, pos)
            if k < len(key):
                if k > 0:
                    child = self._split(child, k)
                    child.last_access = t
                    node = child
                    pos += k
                break
            child.last_access = t
            node = child
            pos += k
        return MatchResult(pos, node)

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Split ``child`` so that its first ``k`` tokens become a new parent node; returns it."""
        parent = child.parent
        new = TreeNode(child.key[:k], parent)
        new.lock_ref = child.lock_ref
        new.last_access = child.last_access
        new.priority = child.priority
        new.sessions = dict(child.sessions)
        new.untagged = child.untagged
        new.hits = child.hits
        for sid in new.sessions:
            self._session_nodes.setdefault(sid, set()).add(new)
        parent.children[new.key[0]] = new
        child.key = child.key[k:]
        child.parent = new
        new.children[child.key[0]] = child
        return new

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> int:
        """inc_lock_ref from ``node`` up to the root; returns tokens moved evictable->protected."""
        delta = 0
        while node is not self.root and node is not None:
            if node.lock_ref == 0:
                self.evictable -= len(node.key)
                delta += len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def unlock(self, node: TreeNode) -> int:
        """dec_lock_ref from ``node`` up to the root; returns tokens moved protected->evictable."""
        delta = 0
        while node is not self.root and node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of an unlocked node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable += len(node.key)
                delta += len(node.key)
            node = node.parent
        return delta

    # ------------------------------------------------------------------ pool
    def alloc(self, n: int) -> None:
        """Take ``n`` private tokens from the pool, evicting the cache if needed.
        Raises ``OutOfTokens`` (pool unchanged apart from evictions) if impossible."""
        if n <= 0:
            return
        if self.available < n:
            self.evict(n - self.available)
        if self.available < n:
            raise OutOfTokens(f"need {n} tokens, available {self.available}")
        self.private += n

    def can_alloc(self, n: int) -> bool:
        """Whether ``alloc(n)`` would succeed (available + evictable >= n)."""
        return self.available + self.evictable >= n

    def free(self, n: int) -> None:
        """Return ``n`` private tokens to the pool uncached (retract/abort path)."""
        if n < 0 or n > self.private:
            raise ValueError(f"free({n}) with private={self.private}")
        self.private -= n

    # ------------------------------------------------------------------ insert
    def insert(self, ids: Sequence[int], session_id: Optional[str] = None, priority: int = 0,
               n_private: int = 0, generation: Optional[int] = None, tag: bool = True,
               chunked: bool = False) -> int:
        """cache_finished_req: insert ``ids`` (tokens whose KV exists) into the tree and release
        ``n_private`` private tokens (the request's own KV). Tokens already cached are freed
        (deduplicated). Returns the number of newly cached tokens. Tags / references every node
        of the path with ``session_id`` when sessions are tracked (and ``tag``: the prefill-end
        insert of a running request, cache_unfinished_req, tags nothing; SGLang registers session
        refs in cache_finished_req only, and not for aborted requests). ``generation`` as in
        :meth:`tracks_sessions`. HiCache: every insert through a node counts a hit and backs it up at the
        write policy's threshold, except the insert of a prefill chunk (hiradix_cache.py _inc_hit_count)."""
        if n_private > self.private:
            raise ValueError("n_private exceeds private allocation")
        t = self._touch()
        node = self.root
        node.last_access = t
        pos = 0
        n = len(ids)
        new_tokens = 0
        path: list[TreeNode] = []
        while pos < n:
            child = node.children.get(ids[pos])
            if child is None:
                leaf = TreeNode(tuple(ids[pos:]), node)
                leaf.last_access = t
                node.children[ids[pos]] = leaf
                new_tokens = n - pos
                self.tree_tokens += new_tokens
                self.evictable += new_tokens
                path.append(leaf)
                pos = n
                break
            k = _common_len(child.key, ids, pos)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = t
            path.append(child)
            node = child
            pos += k
        # the request's private tokens are now either tree-owned (new) or duplicates (freed)
        self.private -= n_private
        if self.private < 0:  # pragma: no cover - guarded above
            raise RuntimeError("negative private")
        track = tag and self.tracks_sessions(session_id, generation)
        for nd in path:
            if priority > nd.priority:
                nd.priority = priority
            if not tag:
                continue
            if track:
                nd.sessions[session_id] = nd.sessions.get(session_id, 0) + 1
                self._session_nodes.setdefault(session_id, set()).add(nd)
            else:
                nd.untagged = True
        if self.host is not None and self.host_write_policy != "write_back" and not chunked:
            threshold = 1 if self.host_write_policy == "write_through" else 2
            upto, hot = 0, True
            for nd in path:          # the path's keys add up to ids
                nd.hits += 1
                hot = hot and nd.hits >= threshold
                if hot:
                    upto += len(nd.key)
            if upto:
                self._backup(ids[:upto], priority)
        return new_tokens

    # ------------------------------------------------------------------ evict
    def _evict_key(self, node: TreeNode):
        base = (node.priority, node.last_access) if self.eviction_policy == "priority" \
            else (node.last_access,)
        if self.session_mode == "0.5.17":
            refs = len(node.sessions)
            return (refs > 0, refs) + base + (node.id,)
        return base + (node.id,)

    def _evictable_leaves(self) -> list[TreeNode]:
        out = []
        stack = [self.root]
        while stack:
            nd = stack.pop()
            if nd.children:
                stack.extend(nd.children.values())
            elif nd is not self.root and nd.lock_ref == 0:
                out.append(nd)
        return out

    def _remove_leaf(self, node: TreeNode) -> int:
        parent = node.parent
        del parent.children[node.key[0]]
        n = len(node.key)
        self.tree_tokens -= n
        if node.lock_ref == 0:
            self.evictable -= n
        for sid in node.sessions:
            s = self._session_nodes.get(sid)
            if s is not None:
                s.discard(node)
                if not s:
                    del self._session_nodes[sid]
        node.parent = None
        return n

    def evict(self, num_tokens: int) -> int:
        """Evict whole unlocked leaves in eviction-key order until at least ``num_tokens`` were
        freed or nothing evictable remains (radix_cache.py evict). Returns tokens evicted."""
        if num_tokens <= 0:
            return 0
        heap = [(self._evict_key(nd), nd) for nd in self._evictable_leaves()]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, nd = heapq.heappop(heap)
            parent = nd.parent
            if self.host is not None and self.host_write_policy == "write_back":
                self._backup(self._path_ids(nd), nd.priority)
            evicted += self._remove_leaf(nd)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._evict_key(parent), parent))
        self.evicted_total += evicted
        return evicted

    # ------------------------------------------------------------------ sessions
    def close_session(self, session_id: str) -> int:
        """Handle /close_session. 0.5.17: drop references + tombstone; 0.5.15: free the session's
        unshared, unlocked, childless leaf chains at once. Returns tokens freed (0 for 0.5.17/off).
        Idempotent; unknown ids do nothing."""
        self.closes_received += 1
        if self.session_mode == "off" or not session_id:
            return 0
        nodes = self._session_nodes.pop(session_id, set())
        if self.session_mode == "0.5.17":
            self.generations.pop(session_id, None)
            for nd in nodes:
                nd.sessions.pop(session_id, None)
            self.closed[session_id] = None
            self.closed.move_to_end(session_id)
            while len(self.closed) > TOMBSTONE_MAX:
                self.closed.popitem(last=False)
            return 0
        # 0.5.15: bulk free of the tagged leaf chains
        freed = 0
        leaves = sorted((nd for nd in nodes if not nd.children), key=lambda nd: nd.id)
        for nd in nodes:
            nd.sessions.pop(session_id, None)
        for leaf in leaves:
            nd = leaf
            while (nd is not self.root and nd.parent is not None and not nd.children
                   and nd.lock_ref == 0 and not nd.sessions and not nd.untagged
                   and nd in nodes):
                parent = nd.parent
                freed += self._remove_leaf(nd)
                nd = parent
        self.session_freed_total += freed
        self.evicted_total += freed
        return freed

    def session_ref_tokens(self, session_id: str) -> int:
        """Tokens in nodes carrying ``session_id`` (references or tags)."""
        return sum(len(nd.key) for nd in self._session_nodes.get(session_id, ()))

    def session_states(self) -> dict[str, dict]:
        """Per session id: ``ref_tokens`` (tokens in nodes it references/tags) and ``closed``
        (tombstoned), for every id with references or a tombstone."""
        out = {sid: {"ref_tokens": self.session_ref_tokens(sid), "closed": sid in self.closed}
               for sid in self._session_nodes}
        for sid in self.closed:
            out.setdefault(sid, {"ref_tokens": 0, "closed": True})
        return out

    def cached_len(self, ids: Sequence[int]) -> int:
        """Read-only longest cached prefix length (tokens); no LRU update, no split."""
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            k = _common_len(child.key, ids, pos)
            pos += k
            if k < len(child.key):
                break
            node = child
        return pos

    def check_invariants(self) -> None:
        """Recompute sizes from the tree; raises AssertionError on any accounting mismatch."""
        total = evictable = 0
        stack = list(self.root.children.values())
        while stack:
            nd = stack.pop()
            assert len(nd.key) > 0
            total += len(nd.key)
            if nd.lock_ref == 0:
                evictable += len(nd.key)
                assert all(c.lock_ref == 0 for c in nd.children.values())
            stack.extend(nd.children.values())
        assert total == self.tree_tokens, (total, self.tree_tokens)
        assert evictable == self.evictable, (evictable, self.evictable)
        assert 0 <= self.available <= self.max_total
        assert self.num_used == self.max_total - (self.available + self.evictable)


def _common_len(key: tuple, ids: Sequence[int], pos: int) -> int:
    n = min(len(key), len(ids) - pos)
    if key[:n] == tuple(ids[pos:pos + n]):
        return n
    i = 0
    while i < n and key[i] == ids[pos + i]:
        i += 1
    return i
