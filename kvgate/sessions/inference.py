"""Prefix-based session inference: which session a request without any session id continues (pure).

The last step of the resolution chain, after body, header and field. No I/O, no
clock of its own: calls that care about time take ``now`` (monotonic seconds).

The rule. An agent turn's prompt is the previous turn's prompt P + that turn's output O + new units
(a tool observation, a user message). A request R *continues* session S when S's last prompt P is a
strict prefix of R. The evidence, strongest first:
  decisive      P + O (the output kvgate relayed) is a prefix of R;
  partial       R covers all of P and at least ``min_output_fraction`` of O (a template that re-renders
                the end of the previous turn, a stop token swapped for an end-of-turn marker);
  rerender      O's last units appear in R shortly after P (a template that drops the reasoning at the
                start of O and keeps the answer);
  prompt-only   S's output is unknown (never observed, empty): only P is known to be a prefix;
  reask         (chat) R continues P with a message that is not S's answer: an agent that dropped an answer it
                could not parse and asks again with feedback (its next prompt extends P, not P + O).
A candidate whose output is known but shows none of the above is excluded (``diverged``): that is
what keeps GRPO siblings apart -- they share the task prompt and part ways at their first output.
A candidate with a request still in flight is skipped unless ``allow_parallel``.
The candidate with the longest matched length wins; a tie on that length is *not* resolved by picking
one: R starts a new session and ``ambiguous`` is counted (two contexts identical by chance).

Units are token ids (``input_ids`` / ``output_ids``) or characters (text and chat prompts; a chat
request is rendered to one string by :func:`chat_to_text`, its answer by :func:`chat_output_text`: tool calls
as function name and arguments, so OpenAI tool-calling agents that echo ``tool_calls`` without SGLang's
``index``, with content null or "", or with arguments re-serialised still link decisively).

Cost. Each request's units are cut into blocks (``block_tokens`` ids or ``block_chars`` characters) and
hashed as a chain (block k's key depends on blocks 1..k). The index maps the chain hash at the last
full block of each session's last prompt to that session; R's chain is walked once, so matching
costs O(blocks of R + candidates x output checkpoints), independent of the number of sessions. A
session keeps only hashes (no units), so memory per session is constant; ``max_sessions`` bounds the
count (the longest idle dropped first, counted in ``dropped``).

Where inference stops being reliable (documented limits):
  - a last prompt shorter than one block is not indexed: its session cannot be continued by inference
    (a first turn shorter than 64 tokens / 256 characters starts a new session each turn);
  - a template that changes text *inside* the previous prompt (a timestamp in the system prompt, a
    generation prompt such as an empty ``<think></think>`` that later turns do not repeat) breaks the
    prefix rule: every turn starts a new session;
  - partial coverage is measured at checkpoint granularity (``output_checkpoints`` points along O,
    each on a block boundary); an output shorter than a block links only decisively or via ``rerender``;
  - rerender evidence needs O's last ``probe`` units verbatim in R within |O| + ``rerender_slack``
    units after P; two siblings whose kept answers are identical are then indistinguishable (tie);
  - ``reask`` needs the chat route (kvgate renders the messages itself); two agents at the same prompt that both
    drop their answers and ask again are a tie (a new session, never a merge): GRPO siblings that drop their
    first answers fragment;
  - with parallel calls in one session, the output is attributed to the last prompt started;
  - hashes are Python's 64-bit hashes (randomised per process for text): a collision is possible in
    principle, negligible for non-adversarial traffic; state does not survive a restart.
"""

from __future__ import annotations

import secrets
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from typing import Any, Iterable

import orjson

from kvgate.common import prefix_hash
from kvgate.common.prefix_hash import is_token_ids

TOKENS, TEXT = 0, 1
_SEED = (0x6B76_6761_7465_0000, 0x6B76_6761_7465_0001)  # chain start per unit kind: tokens never match text

DECISIVE, PARTIAL, RERENDER, PROMPT_ONLY, REASK = "decisive", "partial", "rerender", "prompt-only", "reask"


@dataclass(frozen=True)
class Prepared:
    """R cut into blocks: ``seq`` (str or tuple of ints), ``kind`` (TOKENS|TEXT), ``block`` (units per
    block) and ``chain`` (chain[k] = chain hash after k full blocks; chain[0] is the kind's seed).
    Pass it back to :meth:`SessionInference.on_request_start` to avoid hashing R twice."""

    seq: Any
    kind: int
    block: int
    chain: list[int]


@dataclass(frozen=True)
class InferenceResult:
    """session_id: the session R continues, or a fresh id when it starts one; None when R cannot be
    inferred at all (empty, a batch, not ids or text). decisive: P + O of that session is a prefix of R.
    reason: decisive | partial | rerender | prompt-only | reask | retry | new | new-ambiguous | unsupported
    (retry: R is exactly the prompt of its session's turn still in flight).
    matched_tokens: units of R explained by the session's history (tokens or characters).
    candidates: sessions whose last prompt is a prefix of R that were considered."""

    session_id: str | None
    decisive: bool
    reason: str
    matched_tokens: int
    candidates: int = 0
    prepared: Prepared | None = field(default=None, repr=False, compare=False)

    @property
    def is_new(self) -> bool:
        return self.reason.startswith("new")


class _Track:
    """What inference keeps of one session: hashes and lengths only, never the units."""

    __slots__ = ("sid", "kind", "in_flight", "last_active", "p_len", "p_key", "p_tail", "pending",
                 "o_len", "ck", "end_key", "end_tail", "probe", "turns", "before")
    _STATE = ("kind", "p_len", "p_key", "p_tail", "o_len", "ck", "end_key", "end_tail", "probe")

    def __init__(self, sid: str, now: float):
        self.sid = sid
        self.kind = TOKENS
        self.in_flight = 0
        self.last_active = now
        self.p_len = 0
        self.p_key: int | None = None   # index key: chain hash after p_len // block blocks (None = not indexed)
        self.p_tail = 0                 # hash of P's units after its last full block
        self.pending: Any = None        # P's units after its last full block, kept only while in flight
        self.o_len: int | None = None   # None: the output is unknown
        self.ck: array | None = None    # checkpoints along P + O: [block count, chain hash there, ...]
        self.end_key = 0                # chain hash after (p_len + o_len) // block blocks of P + O
        self.end_tail = 0               # hash of P + O's units after that
        self.probe: Any = None          # O's last units (str, or an array of ids), for rerender evidence
        self.turns = 0
        self.before: tuple | None = None  # the state before the turns in flight, restored if none completes

    def snapshot(self) -> tuple:
        return tuple(getattr(self, k) for k in self._STATE)

    def restore(self, state: tuple) -> None:
        for k, v in zip(self._STATE, state):
            setattr(self, k, v)


def _normalize(units: Sequence[int] | str) -> tuple[Any, int] | None:
    """(seq, kind) with seq a str or a tuple of ints; None for anything else (a batch, empty, a list
    holding anything but ints anywhere: a float, a bool, a nested list)."""
    if isinstance(units, str):
        return (units, TEXT) if units else None
    if isinstance(units, (list, tuple)) and units:
        seq = units if isinstance(units, tuple) else tuple(units)
        if is_token_ids(seq):  # every item, at C speed (kvgate.common.prefix_hash)
            return seq, TOKENS
    return None


#: Chain hashes continuing from ``start`` over blocks n_from+1 .. n_to of ``seq`` (blocks counted from seq[0]):
#: [start, h(n_from+1), ..., h(n_to)]. One C hash per block (kvgate.common.prefix_hash).
_chain = prefix_hash.chain


def _find(seq: Any, probe: Any, lo: int, hi: int) -> int:
    """End index of the first occurrence of ``probe`` in seq[lo:hi], or -1."""
    if isinstance(seq, str):
        i = seq.find(probe, lo, hi)
        return -1 if i < 0 else i + len(probe)
    n = len(probe)
    first = probe[0]
    i = lo
    while True:
        try:
            i = seq.index(first, i, hi - n + 1)
        except ValueError:
            return -1
        if seq[i:i + n] == probe:
            return i + n
        i += 1


class SessionInference:
    """Infers a session for generate requests that name none (see the module docstring for the rules).

    block_tokens / block_chars: units per hashed block for token ids / text (64 / 256 by default).
    min_output_fraction: share of the previous output R must cover for ``partial`` evidence, in [0, 1].
    allow_parallel: sessions with a request in flight stay candidates.
    max_sessions: cap on tracked sessions; the longest idle is dropped first (``dropped``).
    output_checkpoints: points along each output where its chain hash is kept (partial resolution).
    probe_tokens / probe_chars: length of O's tail kept for ``rerender`` evidence (0 disables it).
    rerender_slack: units beyond |O| after P in which the probe is searched.
    """

    def __init__(self, *, block_tokens: int = 64, block_chars: int = 256, min_output_fraction: float = 0.5,
                 allow_parallel: bool = False, max_sessions: int = 100_000, output_checkpoints: int = 16,
                 probe_tokens: int = 8, probe_chars: int = 48, rerender_slack: int = 256, id_prefix: str = "inf-"):
        if block_tokens < 1 or block_chars < 1 or max_sessions < 1 or output_checkpoints < 1:
            raise ValueError("block sizes, max_sessions and output_checkpoints must be >= 1")
        if not 0.0 <= min_output_fraction <= 1.0:
            raise ValueError("min_output_fraction must be in [0, 1]")
        self.blocks = (block_tokens, block_chars)
        self.min_output_fraction = min_output_fraction
        self.allow_parallel = allow_parallel
        self.max_sessions = max_sessions
        self.output_checkpoints = output_checkpoints
        self.probes = (probe_tokens, probe_chars)
        self.rerender_slack = rerender_slack
        self.id_prefix = id_prefix
        self._tracks: OrderedDict[str, _Track] = OrderedDict()  # first = longest idle
        self._index: dict[int, Any] = {}  # p_key -> sid (str) or list of sids
        self.counts = {"infer": 0, "unsupported": 0, "new": 0, "ambiguous": 0, DECISIVE: 0, PARTIAL: 0,
                       RERENDER: 0, PROMPT_ONLY: 0, REASK: 0, "diverged": 0, "busy_skipped": 0, "dropped": 0,
                       "output_ignored": 0, "retry": 0, "abandoned": 0, "refused": 0}

    # --- lookup ------------------------------------------------------------------------------------

    def prepare(self, units: Sequence[int] | str) -> Prepared | None:
        """Hash R's blocks once: O(len(R)). None when R is not a non-empty id list or string."""
        norm = _normalize(units)
        if norm is None:
            return None
        seq, kind = norm
        block = self.blocks[kind]
        return Prepared(seq, kind, block, _chain(seq, block, _SEED[kind], 0, len(seq) // block))

    def infer(self, units: Sequence[int] | str, now: float) -> InferenceResult:
        """Which session R continues. Mutates nothing but counters: call :meth:`on_request_start` with
        the returned id (and ``prepared``) for R to become that session's last prompt."""
        self.counts["infer"] += 1
        try:
            prep = self.prepare(units)
        except TypeError:  # unhashable elements (a batch of lists, dicts)
            prep = None
        if prep is None:
            self.counts["unsupported"] += 1
            return InferenceResult(None, False, "unsupported", 0)
        seq, chain, block = prep.seq, prep.chain, prep.block
        n_r = len(seq)
        get = self._index.get
        best_m, best, tied, considered = -1, None, False, 0
        for k in range(1, len(chain)):
            hit = get(chain[k])
            if hit is None:
                continue
            for sid in ((hit,) if isinstance(hit, str) else tuple(hit)):
                t = self._tracks.get(sid)
                if t is None or t.kind != prep.kind or t.p_len // block != k or n_r <= t.p_len:
                    continue
                if hash(seq[k * block:t.p_len]) != t.p_tail:
                    continue  # the blocks match but P's last partial block does not
                considered += 1
                if t.in_flight and not self.allow_parallel:
                    self.counts["busy_skipped"] += 1
                    continue
                m, level = self._evidence(t, prep)
                if level is None:
                    self.counts["diverged"] += 1
                    continue
                if m > best_m:
                    best_m, best, tied = m, (t, level), False
                elif m == best_m:
                    tied = True
        if best is None:
            retry = self._retry_of(prep)
            if retry is not None:
                self.counts["retry"] += 1
                return InferenceResult(retry.sid, False, "retry", len(seq), considered, prep)
            self.counts["new"] += 1
            return InferenceResult(self._new_id(), False, "new", 0, considered, prep)
        if tied:
            self.counts["ambiguous"] += 1
            return InferenceResult(self._new_id(), False, "new-ambiguous", best_m, considered, prep)
        t, level = best
        self.counts[level] += 1
        return InferenceResult(t.sid, level == DECISIVE, level, best_m, considered, prep)

    def _evidence(self, t: _Track, prep: Prepared) -> tuple[int, str | None]:
        """(matched length, level) of R against t's P + O; level None = the output diverged."""
        if not t.o_len:
            return t.p_len, PROMPT_ONLY
        seq, chain, block = prep.seq, prep.chain, prep.block
        end = t.p_len + t.o_len
        n_full = len(chain) - 1
        if len(seq) >= end:
            k_end = end // block
            if chain[k_end] == t.end_key and hash(seq[k_end * block:end]) == t.end_tail:
                return end, DECISIVE
        covered = 0
        ck = t.ck or ()
        for i in range(0, len(ck), 2):  # a chain: a match at block b implies all before it matched
            b = ck[i]
            if b > n_full or chain[b] != ck[i + 1]:
                break
            covered = b * block
        if covered > t.p_len and (covered - t.p_len) >= self.min_output_fraction * t.o_len:
            return covered, PARTIAL
        if t.probe is not None:
            hi = min(len(seq), end + self.rerender_slack)
            at = _find(seq, t.probe if t.kind == TEXT else tuple(t.probe), t.p_len, hi)
            if at >= 0:
                return at, RERENDER
        if t.kind == TEXT and seq.startswith(_ROLE, t.p_len) and not seq.startswith(_ASSISTANT, t.p_len):
            # A chat prompt followed by a message that is not the answer: the client dropped the answer (one it
            # could not parse) and asks again with feedback. Siblings part ways at their answers, which they keep.
            return t.p_len, REASK
        return 0, None

    def _retry_of(self, prep: Prepared) -> _Track | None:
        """The session whose turn in flight has exactly R as its prompt: a client retrying a turn it gave
        up on (a timeout, then the same request again) before kvgate saw the first attempt end."""
        n = len(prep.seq) // prep.block
        if n < 1:
            return None
        hit = self._index.get(prep.chain[n])
        for sid in ((hit,) if isinstance(hit, str) else tuple(hit or ())):
            t = self._tracks.get(sid)
            # Only a turn that continued a completed one: identical first prompts sent together are GRPO
            # siblings, not retries (they part ways at their outputs).
            if (t is not None and t.in_flight and t.pending is not None and t.before is not None
                    and t.before[1] > 0 and t.kind == prep.kind and t.p_len == len(prep.seq)
                    and hash(prep.seq[n * prep.block:]) == t.p_tail):
                return t
        return None

    def _new_id(self) -> str:
        return self.id_prefix + secrets.token_urlsafe(12)

    # --- request hooks -------------------------------------------------------------------------------

    def on_request_start(self, session_id: str, units: Sequence[int] | str, now: float,
                         prepared: Prepared | None = None) -> None:
        """R (``units``) starts in ``session_id``: it becomes the session's last prompt, its output unknown,
        until the turn ends. If no turn in flight completes (:meth:`on_request_end` with completed=False:
        the client gave up, an error), the session goes back to its prompt and output from before, so an
        identical retry still extends it. ``prepared`` from :meth:`infer` saves re-hashing R (it must be
        R's). Never raises for odd units: everything that can fail is computed before any change."""
        try:
            prep = prepared if prepared is not None else self.prepare(units)
            if prep is not None:
                n = len(prep.seq) // prep.block
                tail = prep.seq[n * prep.block:]
                new = (prep.kind, len(prep.seq), prep.chain[n] if n >= 1 else None, hash(tail), tail)
            else:
                new = None
        except TypeError:  # unhashable units: the turn counts as in flight, its prompt is not kept
            new = None
        t = self._tracks.get(session_id)
        if t is None:
            t = _Track(session_id, now)
            self._tracks[session_id] = t
            self._evict_over_cap()
        else:
            self._tracks.move_to_end(session_id)
        if t.in_flight == 0:
            t.before = t.snapshot()
        self._unindex(t)
        t.in_flight += 1
        t.turns += 1
        t.last_active = now
        t.o_len, t.ck, t.probe, t.pending = None, None, None, None
        if new is None:
            t.p_len, t.p_key = 0, None
            return
        t.kind, t.p_len, t.p_key, t.p_tail, t.pending = new
        self._reindex(t)

    def on_response(self, session_id: str, output: Sequence[int] | str, now: float) -> None:
        """The output kvgate relayed for the session's request in flight (``output_ids`` or the text).
        Ignored (counted) when the session is unknown, has no pending prompt or the kinds differ."""
        t = self._tracks.get(session_id)
        norm = _normalize(output) if output is not None else None
        if t is None or t.pending is None or norm is None or norm[1] != t.kind:
            self.counts["output_ignored"] += 1
            return
        out, kind = norm
        block = self.blocks[kind]
        seq = t.pending + out  # P's partial last block + O, aligned to P's block grid
        k0 = t.p_len // block
        nb = len(seq) // block
        start = t.p_key if k0 >= 1 else _SEED[kind]
        chain = _chain(seq, block, start, 0, nb)  # chain[j] = hash after k0 + j blocks of P + O
        t.o_len = len(out)
        t.end_key = chain[nb]
        t.end_tail = hash(seq[nb * block:])
        c = self.output_checkpoints
        js = sorted({max(1, (nb * i) // c) for i in range(1, c + 1)}) if nb else []
        t.ck = array("q", [x for j in js for x in (k0 + j, chain[j])]) if js else None
        n_probe = self.probes[kind]
        t.probe = None
        if n_probe > 0:
            if kind == TEXT:
                body = out.rstrip()
                if len(body) >= n_probe:
                    t.probe = body[-n_probe:]
            elif len(out) > n_probe:  # leave out the last id: often a stop token the template re-renders
                try:
                    t.probe = array("q", out[-n_probe - 1:-1])
                except (OverflowError, TypeError):
                    t.probe = None
        t.last_active = now

    def on_request_end(self, session_id: str, now: float, completed: bool = True, refused: bool = False) -> None:
        """The session's request ended; call after :meth:`on_response`. ``completed``: the upstream answered
        it in full with a success status. When the last turn in flight ends and none of them completed,
        the session's prompt and output go back to what they were before (counted as ``abandoned``).
        ``refused``: the upstream refused it (a 4xx: nothing ran on an engine): it is no turn (counted as
        ``refused``), and a session no turn is left of is forgotten."""
        t = self._tracks.get(session_id)
        if t is None:
            return
        t.in_flight = max(0, t.in_flight - 1)
        t.last_active = now
        if refused:
            t.turns = max(0, t.turns - 1)
            self.counts["refused"] += 1
        if completed:
            t.before = None
        if t.in_flight == 0:
            t.pending = None
            if refused and t.turns == 0:
                self.forget(session_id)
                return
            if t.before is not None:
                self._unindex(t)
                t.restore(t.before)
                self._reindex(t)
                if not refused:
                    self.counts["abandoned"] += 1
            t.before = None
        self._tracks.move_to_end(session_id)

    def forget(self, session_id: str) -> bool:
        """Stop tracking a session (the client ended it); True when it was tracked."""
        t = self._tracks.pop(session_id, None)
        if t is None:
            return False
        self._unindex(t)
        return True

    # --- bookkeeping -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._tracks)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._tracks

    def stats(self) -> dict[str, Any]:
        """Counters (see InferenceResult.reason), tracked sessions and index keys."""
        return {**self.counts, "tracked": len(self._tracks), "index_keys": len(self._index)}

    def _reindex(self, t: _Track) -> None:
        if t.p_key is None:
            return
        cur = self._index.get(t.p_key)
        if cur is None:
            self._index[t.p_key] = t.sid
        elif isinstance(cur, str):
            if cur != t.sid:
                self._index[t.p_key] = [cur, t.sid]
        elif t.sid not in cur:
            cur.append(t.sid)

    def _unindex(self, t: _Track) -> None:
        if t.p_key is None:
            return
        cur = self._index.get(t.p_key)
        if cur is None:
            return
        if isinstance(cur, str):
            if cur == t.sid:
                del self._index[t.p_key]
        else:
            try:
                cur.remove(t.sid)
            except ValueError:
                return
            if len(cur) == 1:
                self._index[t.p_key] = cur[0]

    def _evict_over_cap(self) -> None:
        while len(self._tracks) > self.max_sessions:
            victim = next((t for t in self._tracks.values() if t.in_flight == 0), None)
            if victim is None:
                return
            del self._tracks[victim.sid]
            self._unindex(victim)
            self.counts["dropped"] += 1


# --- chat rendering ----------------------------------------------------------------------------------

_ROLE, _BODY, _END = "\x02", "\x03", "\x04"  # control characters: never produced by a chat template
_ASSISTANT = f"{_ROLE}assistant{_BODY}"


def _calls_text(calls: Any) -> str:
    """A message's tool calls as clients echo them back: each call's function name and its arguments, the
    arguments parsed and written again with sorted keys when they are JSON (a client may re-serialise them).
    The call's ``id``, ``type`` and ``index`` are left out: clients drop ``index`` (SGLang sends it), and some
    make their own ids."""
    if not isinstance(calls, list):
        calls = [calls]
    norm = []
    for c in calls:
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping):
            norm.append(c)
            continue
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = orjson.loads(args)
            except orjson.JSONDecodeError:
                pass
        norm.append([fn.get("name"), args])
    try:
        return orjson.dumps(norm, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:  # orjson.JSONEncodeError: nested deeper than orjson writes (254 levels), a non-str key
        return repr(norm)


def _message_body(message: Mapping[str, Any]) -> str:
    """One message's rendered body: its text content (text parts joined, other parts marked), then its tool
    calls (:func:`_calls_text`). ``reasoning_content`` is left out on purpose, so a client that drops reasoning
    still links; ``content`` null, "" and absent are the same."""
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text parts, mark the others
        parts = []
        for p in content:
            if isinstance(p, Mapping):
                parts.append(p["text"] if isinstance(p.get("text"), str) else f"[{p.get('type', 'part')}]")
            elif isinstance(p, str):
                parts.append(p)
        text = "".join(parts)
    else:
        text = content if isinstance(content, str) else ""
    calls = message.get("tool_calls")
    if calls:
        text += _calls_text(calls)
    return text


def chat_output_text(message: Mapping[str, Any] | None) -> str:
    """The answer ``message`` (the response's ``choices[0].message``, or the accumulated stream deltas) rendered
    as the assistant turn it becomes when the client keeps it: chat_to_text(msgs) + chat_output_text(answer) is a
    prefix of chat_to_text(msgs + [answer] + more). "" for anything but a mapping."""
    if not isinstance(message, Mapping):
        return ""
    return f"{_ASSISTANT}{_message_body(message)}{_END}"


def chat_to_text(messages: Iterable[Mapping[str, Any]] | Any, add_generation_prompt: bool = False) -> str | None:
    """Render chat ``messages`` to one string, deterministically: each message is ROLE name BODY text END
    (control characters). No generation prompt by default: the answer (:func:`chat_output_text`) starts with the
    assistant header, so a client that drops the answer and asks again with feedback (a user or tool message
    right after the prompt) still extends the prompt, and ``reask`` evidence can tell it apart. None when
    ``messages`` is not a list of objects."""
    if not isinstance(messages, list):
        return None
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            return None
        role = m.get("role") if isinstance(m.get("role"), str) else "user"
        name = m.get("name") or m.get("tool_call_id")
        head = f"{role}:{name}" if isinstance(name, str) else role
        out.append(f"{_ROLE}{head}{_BODY}{_message_body(m)}{_END}")
    if add_generation_prompt:
        out.append(_ASSISTANT)
    return "".join(out)


# --- what the proxy feeds in ---------------------------------------------------------------------

def _single(body: Mapping[str, Any]) -> bool:
    """One sequence: no n > 1 (top level on the OpenAI routes, in sampling_params on /generate)."""
    for holder in (body, body.get("sampling_params")):
        if type(holder) is dict or isinstance(holder, Mapping):  # a dict first: an ABC check is a Python call
            n = holder.get("n")
            if isinstance(n, int) and not isinstance(n, bool) and n > 1:
                return False
    return True


def request_units(path: str, body: Mapping[str, Any]) -> Sequence[int] | str | None:
    """The units inference matches for a generate request body, or None (then do not infer).

    /generate: ``input_ids`` when a flat id list, else ``text`` when a string; /v1/completions: ``prompt``
    when a string or a flat id list; /v1/chat/completions: chat_to_text(``messages``). Batches
    (a list of prompts), n > 1, input_embeds and /v1/responses (server-side state) give None."""
    if not (type(body) is dict or isinstance(body, Mapping)) or not _single(body):
        return None
    if path == "/generate":
        ids_ = body.get("input_ids")
        if isinstance(ids_, list) and ids_ and isinstance(ids_[0], int) and not isinstance(ids_[0], bool):
            return ids_
        text = body.get("text")
        return text if isinstance(text, str) and text and "input_embeds" not in body else None
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) and not isinstance(prompt[0], bool):
            return prompt
        return None
    if path == "/v1/chat/completions":
        return chat_to_text(body.get("messages"))
    return None


def response_units(path: str, obj: Any, prompt_kind_text: bool) -> Sequence[int] | str | None:
    """The output to pass to on_response from a final (non-stream, or last cumulative /generate stream)
    response object: /generate ``output_ids`` when the prompt was ids (``text`` when it was text);
    /v1/completions ``choices[0].text``; /v1/chat/completions chat_output_text(``choices[0].message``).
    A streamed OpenAI response must be accumulated first (deltas) into that same shape."""
    if not (type(obj) is dict or isinstance(obj, Mapping)):
        return None
    if path == "/generate":
        if prompt_kind_text:
            text = obj.get("text")
            return text if isinstance(text, str) else None
        out = obj.get("output_ids")
        return out if isinstance(out, list) else None
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return None
    c0 = choices[0]
    if path == "/v1/completions":
        text = c0.get("text")
        return text if isinstance(text, str) else None
    if path == "/v1/chat/completions":
        msg = c0.get("message")
        return chat_output_text(msg) if isinstance(msg, Mapping) else None
    return None


# --- accuracy ----------------------------------------------------------------------------------------

def score(predicted: Sequence[Any], truth: Sequence[Any]) -> tuple[float, float]:
    """Pairwise precision and recall of a session assignment.

    predicted[i], truth[i]: the session label of request i. A pair (i < j) is "same-session" when the
    labels agree. precision = correct same-session pairs / predicted same-session pairs; recall =
    correct / true same-session pairs. With no predicted pairs precision is 1.0 (nothing wrongly merged);
    with no true pairs recall is 1.0. O(n) via pair counts per label and per (label, label).
    """
    if len(predicted) != len(truth):
        raise ValueError("predicted and truth must have the same length")
    per_p: dict[Any, int] = {}
    per_t: dict[Any, int] = {}
    per_both: dict[tuple[Any, Any], int] = {}
    for p, q in zip(predicted, truth):
        per_p[p] = per_p.get(p, 0) + 1
        per_t[q] = per_t.get(q, 0) + 1
        per_both[(p, q)] = per_both.get((p, q), 0) + 1

    def pairs(counts: dict) -> int:
        return sum(c * (c - 1) // 2 for c in counts.values())

    tp, pp, tt = pairs(per_both), pairs(per_p), pairs(per_t)
    return (tp / pp if pp else 1.0), (tp / tt if tt else 1.0)


def _is_id(v: Any) -> bool:
    return type(v) is int


def prefix_keys(units: Sequence[int] | str | None, block_tokens: int = 64, block_chars: int = 256,
                memo: prefix_hash.BlockDigests | None = None) -> list[int]:
    """The prompt fingerprint session placement matches on: the chain hashes of ``units`` after 1, 2, ...
    full blocks (the same chain inference indexes), or [] when ``units`` is not a non-empty id list or string.
    Two prompts that agree on their first k blocks share their first k keys.

    An id list is hashed as it is, its first and last items checked (as the admission estimate does), not
    copied and checked item by item as inference does (that was more than half the cost: 74 of 133 us at 8K
    tokens). A list with other values inside still gets keys; SGLang refuses such a request, so where it goes
    does not matter, and nothing else reads these keys. ``memo``: the request's block hashes, shared with the
    admission estimate's prefix blocks (prefix_hash.BlockDigests)."""
    if isinstance(units, (list, tuple)):
        if not units or not (_is_id(units[0]) and _is_id(units[-1])):
            return []
        try:
            return _chain(units, block_tokens, _SEED[TOKENS], 0, len(units) // block_tokens, memo)[1:]
        except TypeError:  # an unhashable item (a nested list): no fingerprint
            return []
    norm = _normalize(units) if units is not None else None
    if norm is None:
        return []
    seq, kind = norm
    block = (block_tokens, block_chars)[kind]
    return _chain(seq, block, _SEED[kind], 0, len(seq) // block)[1:]
