"""Placement counts the KV sessions hold and are expected to grow to (kvgate.fleet.placement, "projected KV")."""

from collections import defaultdict

from hypothesis import given, settings, strategies as st

from kvgate.fleet.placement import Placement, Target
from kvgate.sessions.inference import prefix_keys

A, B = "http://a:1", "http://b:1"
CAP = 12_000
SYSTEM = list(range(1, 3001))  # the ~3,000-token system prompt and task every agent starts from
OUTPUT, USER = 600, 100        # tokens each turn generates, and the next user message


def run_agents(n_agents: int, used_reported: bool, session_growth: bool = True) -> tuple[list[int], Placement, dict]:
    """``n_agents`` agents over SYSTEM, sent one after another (each runs its 3 turns before the next starts,
    no session ids from the client: none is ever closed), on two 12,000-token engines. Each grows to 3,000 +
    3 x 600 + 2 x 100 = 5,000 tokens. used_reported: the engines' figures count the KV the sessions hold
    (session lifecycle holds it); else it is evictable between turns and used reads 0 at every scrape.
    Returns the sessions per engine, the placement and each agent's engine per turn."""
    p = Placement(session_growth=session_growth)  # pressure_threshold 0.85: 10,200 of 12,000
    p.set_engines([(A, True), (B, True)])
    p.set_capacity({A: [(CAP, 0, 0)], B: [(CAP, 0, 0)]}, 0.0)
    now, held, turns = 0.0, {}, defaultdict(list)
    for i in range(n_agents):
        sid, prompt = f"agent{i}", list(SYSTEM)
        for turn in range(3):
            now += 1.0
            keys = prefix_keys(prompt)
            t = p.place(sid, keys, now, prompt_tokens=len(prompt))
            p.remember_prefix(keys, t)
            turns[sid].append(t.engine)
            call = p.call_started(t, len(prompt), now, sid)
            own = 100_000 * (i + 1) + 1_000 * turn
            prompt = prompt + list(range(own, own + OUTPUT))       # the answer
            p.call_finished(t, call, now + 0.5)
            p.observed(sid, len(prompt))                          # meta_info: prompt + completion tokens
            held[sid] = (t.engine, len(prompt))
            if turn < 2:
                prompt = prompt + list(range(own + OUTPUT, own + OUTPUT + USER))
            used = {u: 0 for u in (A, B)}
            if used_reported:  # the shared prompt once per engine, each session's own part on top
                for e, size in held.values():
                    used[e] += size - len(SYSTEM) + (len(SYSTEM) if used[e] == 0 else 0)
            p.set_capacity({u: [(CAP, used[u], 0)] for u in (A, B)}, now + 0.75)
    return [p.sessions_on(A), p.sessions_on(B)], p, turns


def test_eight_agents_over_one_long_prompt_spread_once_their_growth_would_outgrow_an_engine():
    """Before, with the KV evictable between turns: the prefix rule saw the prefix's engine under the threshold at
    every arrival (the agents' growth was in no figure, and never is): 8 + 0, 3,000 + 8 x 2,000 = 19,000 tokens
    of sessions on a 12,000-token engine (with the engines reporting the held KV it was 4 + 4 already). Now an
    engine takes a sibling while its projected KV (5,000 held per grown sibling, the 3,000 prompt once) plus
    the sibling's 2,000 stays under 10,200: four per engine, 11,000 each, in both cases, and every agent's turns
    stay on its engine."""
    for used_reported in (False, True):
        per_engine, p, turns = run_agents(8, used_reported)
        assert per_engine == [4, 4], used_reported
        assert all(len(set(engines)) == 1 for engines in turns.values())
        assert [turns[f"agent{i}"][0] for i in range(8)] == [A, A, A, B, B, B, B, A]
        info = p.as_json()
        assert (info[A]["held_tokens"], info[B]["held_tokens"]) == (11_000, 11_000)
        assert (info[A]["expected_growth_tokens"], info[B]["expected_growth_tokens"]) == (0, 0)
        assert p.counts["kv_moved"] == 2 and p.counts["pressed_stay"] == 1  # agent6: B 1,000 free, A 1,000 too
        for i in range(8):
            p.forget(f"agent{i}")
        assert p._kv == {}                      # ended sessions stop counting: nothing left


def test_a_session_admission_found_ended_counts_nowhere_until_its_next_call():
    """Three finished one-turn jobs (sessions kvgate inferred, never closed) of 4,000 tokens on A: while they
    count, new agents over one prompt crowd onto B. Once the program policy finds them ended (idle past what
    the gaps between turns predict) they are dormant: A's projected KV and session count drop to what is live,
    the agents spread as with no jobs, and a job that comes back counts again, on its own engine."""
    def fleet():
        p = Placement()
        p.set_engines([(A, True), (B, True)])
        p.set_capacity({A: [(CAP, 0, 0)], B: [(CAP, 0, 0)]}, 0.0)
        for j in range(3):
            t = p.place(f"job{j}", [900 + j], 0.0, prompt_tokens=3_800)
            assert t == Target(A) or j > 0
            p.move(f"job{j}", Target(A), 0.0)  # wherever free KV put it, the three are on A
            p.observed(f"job{j}", 4_000)
        return p

    counted = fleet()
    assert counted.as_json()[A]["held_tokens"] == 12_000 and counted.sessions_on(A) == 3
    p = fleet()
    assert [p.dormant(f"job{j}") for j in range(3)] == [True] * 3 and p.dormant("job0") is False
    assert p.as_json()[A]["held_tokens"] == 0 and p.sessions_on(A) == 0 and p._kv == {}
    on = {}
    for q in (counted, p):
        placed = [q.place(f"agent{i}", [7, 8 + i], 1.0 + i, prompt_tokens=1_000).engine for i in range(4)]
        on[q is p] = (placed.count(A), placed.count(B))
    assert on[False] == (0, 4) and on[True] == (2, 2)
    assert p.place("job1", [901], 9.0, prompt_tokens=4_100) == Target(A) and p.last_reason == "sticky"
    assert p.sessions_on(A) == 3 and p.as_json()[A]["held_tokens"] == 2 * 1_000 + 4_000
    for sid in [f"job{j}" for j in range(3)] + [f"agent{i}" for i in range(4)]:
        p.forget(sid)
    assert p._kv == {}


def test_with_session_growth_off_the_agents_pile_onto_the_prefix_engine_unless_the_engines_report_the_kv():
    """placement_session_growth: false is the engines' figures alone: with the KV evictable between turns every
    agent finds the prefix's engine under the threshold (8 + 0, 19,000 tokens of sessions on a 12,000-token
    engine); with the held KV reported, usage crosses 10,200 after the fourth agent and the rest go to B."""
    per_engine, p, _ = run_agents(8, False, session_growth=False)
    assert per_engine == [8, 0] and p.counts["prefix"] == 7 and p.counts["kv_moved"] == 0
    per_engine, p, _ = run_agents(8, True, session_growth=False)
    assert per_engine == [4, 4]


def test_where_room_suffices_affinity_still_wins():
    """One agent, or three (3,000 + 3 x 2,000 = 9,000 projected, under 10,200): all on the prefix's engine."""
    for used_reported in (False, True):
        assert run_agents(1, used_reported)[0] == [1, 0]
        per_engine, p, _ = run_agents(3, used_reported)
        assert per_engine == [3, 0] and p.counts["prefix"] == 2 and p.counts["kv_moved"] == 0


def test_siblings_are_expected_to_grow_like_the_longest_of_their_group():
    """A live sibling that has not grown yet counts the growth its group showed (here 5,000 - 3,000 = 2,000
    each), and a session's own history counts (its largest prompt + output); forgetting one takes its part
    off, the group's history stays for the next sibling."""
    p = Placement()
    p.set_engines([(A, True), (B, True)])
    p.set_capacity({A: [(CAP, 0, 0)], B: [(CAP, 0, 0)]}, 0.0)
    keys = prefix_keys(SYSTEM)
    t = p.place("g0", keys, 1.0, prompt_tokens=3_000)
    p.remember_prefix(keys, t)
    for sid in ("g1", "g2"):
        assert p.place(sid, keys, 2.0, prompt_tokens=3_000) == t
    kv = p.as_json()[t.engine]
    assert (kv["held_tokens"], kv["expected_growth_tokens"], kv["projected_tokens"]) == (3_000, 0, 3_000)
    p.observed("g0", 5_000)
    kv = p.as_json()[t.engine]
    assert (kv["held_tokens"], kv["expected_growth_tokens"], kv["projected_tokens"]) == (5_000, 4_000, 9_000)
    call = p.call_started(t, 4_000, 3.0, "g1")  # g1's next prompt: it holds 4,000 now, 1,000 still to come
    kv = p.as_json()[t.engine]
    assert (kv["held_tokens"], kv["expected_growth_tokens"]) == (6_000, 3_000)
    # the fourth sibling would make 9,000 + 2,000 = 11,000 >= 10,200: it goes where there is room
    assert p.place("g3", keys, 4.0, prompt_tokens=3_000).engine != t.engine and p.counts["kv_moved"] == 1
    other = p.as_json()[B if t.engine == A else A]
    assert (other["held_tokens"], other["expected_growth_tokens"]) == (3_000, 2_000)
    p.call_finished(t, call, 3.5)
    for sid in ("g0", "g1", "g2", "g3"):
        assert p.forget(sid)
    assert p._kv == {} and p.as_json()[t.engine]["projected_tokens"] == 0
    p.place("g4", keys, 5.0, prompt_tokens=3_000)
    assert p._sessions["g4"].group.grown == 5_000  # the ended siblings' history


# --- the property --------------------------------------------------------------------------------------

URLS = [f"http://e{i}:1" for i in range(6)]
GROUP_KEYS = [[1000 * g + 1, 1000 * g + 2, 1000 * g + 3] for g in range(3)]


def group_keys(g: int, sid_n: int, x: int) -> list[int]:
    """A prompt's chain keys: group ``g``'s shared prompt (3: none), with an own block when ``x`` is odd."""
    return [] if g == 3 else GROUP_KEYS[g] + ([50_000 + sid_n] if x % 2 else [])


def scratch(p: Placement) -> tuple[dict, dict]:
    """From the sessions alone: (engine, rank) -> [live sessions, held, growth], and each group's cells."""
    cells: dict[int, dict] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    groups = {}
    for s in p._sessions.values():
        if s.dormant:  # ended by admission's evidence: counts nowhere until its next call
            continue
        key = (s.target.engine, s.target.dp_rank or 0)
        c = cells[id(s.group)][key]
        c[0] += 1
        c[1] += s.peak
        groups[id(s.group)] = s.group
        assert s.group.grown >= s.peak
    sums: dict = defaultdict(lambda: [0, 0, 0])
    for gid, per in cells.items():
        for key, (n, peaks) in per.items():
            h, r = groups[gid].kv(n, peaks)
            sums[key][0] += n
            sums[key][1] += h
            sums[key][2] += r
    return dict(sums), {gid: {k: list(v) for k, v in per.items()} for gid, per in cells.items()}


def projected(p: Placement, sums: dict, url: str) -> int | None:
    e = p._engines[url]
    if not e.pools:
        return None
    _, held, growth = sums.get((url, 0), [0, 0, 0])
    return max(e.pools[0][1] + e.in_flight.get(0, 0), held) + growth


EVENT = st.tuples(
    st.sampled_from(["place", "place", "place", "start", "finish", "observe", "observe", "forget", "figures",
                     "health", "move", "dormant"]),
    st.integers(0, 7), st.integers(0, 5), st.integers(0, 9_000))
EVENTS = st.lists(EVENT, min_size=10, max_size=60)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(1_000, 20_000)), min_size=1, max_size=6),
       st.lists(st.integers(0, 3), min_size=8, max_size=8), EVENTS)
def test_no_session_goes_where_it_does_not_fit_while_another_engine_has_room_and_sums_never_drift(caps, groups,
                                                                                                  events):
    """Over random fleets (1-6 single-rank engines, capacities, some without figures yet), sessions in random
    prefix groups (group 3: no shared prompt) and random event orders:

    - whenever place() puts a new or re-placed session by the prefix or free-KV rule on an engine x with
      figures where it does not fit (x's projected KV before the placement + the session's expected size there
      > x's capacity), no other usable engine has room for it: each one with figures would exceed its
      capacity as well (paying the re-prefill of the shared prompt where no live sibling holds it), and none
      is without figures (an engine without figures counts as fully free). The expected size is the group's
      largest size after the placement (max of its history and this prompt); a rank where live siblings hold
      the shared prompt takes it less that prompt. Projected KV is recomputed from scratch here.
    - the per-engine running sums (and each group's cells) equal a recomputation from the sessions after
      every event (a dormant session, ended by admission's evidence, counting nowhere until its next call or
      move), and nothing is left once every session is forgotten."""
    caps = list(caps)
    urls = URLS[:len(caps)]
    p = Placement(max_sessions=6, reopen_hint_s=0.0)  # no reopen hints: the reopened rule keeps its own test
    healthy = [True] * len(urls)
    p.set_engines([(u, True) for u in urls])
    p.set_capacity({u: [(c, 0, 0)] for u, c in zip(urls, caps) if c is not None}, 0.0)
    calls, now = [], 0.0
    for op, sid_n, x, size in events:
        now += 1.0
        sid = f"s{sid_n}"
        if op == "place":
            keys = group_keys(groups[sid_n], sid_n, x)
            before, cells_before = scratch(p)
            s0 = p._sessions.get(sid)
            peak0 = 0 if s0 is None else s0.peak
            t = p.place(sid, keys, now, prompt_tokens=size)
            if t is None:
                continue
            p.remember_prefix(keys, t)
            if p.last_reason in ("prefix", "free_kv"):
                s = p._sessions[sid]
                expect = s.group.grown
                assert expect == max(size, peak0, expect)

                def room(url: str) -> int | None:
                    proj = projected(p, before, url)
                    if proj is None:
                        return None
                    live = cells_before.get(id(s.group), {}).get((url, 0), [0])[0]
                    if s0 is not None and s0.target.engine == url:
                        live -= 1  # a re-placed session does not hold its own prompt for itself
                    adds = max(0, expect - s.group.shared) if live > 0 else expect
                    return p._engines[url].pools[0][0] - proj - adds

                r = room(t.engine)
                if r is not None and r < 0:
                    for u, ok in zip(urls, healthy):
                        if ok and u != t.engine:
                            other = room(u)
                            assert other is not None and other < 0, (t.engine, r, u, other)
        elif op == "start" and sid in p._sessions:
            s = p._sessions[sid]
            calls.append((s.target, p.call_started(s.target, size, now, sid)))
        elif op == "finish" and calls:
            target, h = calls.pop(x % len(calls))
            p.call_finished(target, h, now)
        elif op == "observe":
            p.observed(sid, size)
        elif op == "forget":
            p.forget(sid, now)
        elif op == "figures":
            u = urls[x % len(urls)]
            c = caps[x % len(urls)] or 10_000
            p.set_capacity({u: [(c, min(size, c), 0)]}, now)
            caps[x % len(urls)] = c
        elif op == "health":
            healthy[x % len(urls)] = not healthy[x % len(urls)]
            p.set_engines(list(zip(urls, healthy)))
        elif op == "move":
            p.move(sid, Target(urls[x % len(urls)]), now)
        elif op == "dormant":
            s0 = p._sessions.get(sid)
            counted = s0 is not None and not s0.dormant
            assert p.dormant(sid) is counted
        sums, cells = scratch(p)
        assert p._kv == sums
        live_groups = {id(s.group): s.group for s in p._sessions.values()}
        for gid, g in live_groups.items():
            assert g.cells == cells.get(gid, {})
    for sid in list(p._sessions):
        p.forget(sid)
    assert p._kv == {} and all(not g.cells for g in p._groups.values())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(1_000, 6_000)), min_size=2, max_size=4),
       st.lists(st.integers(0, 2), min_size=8, max_size=8),
       st.lists(EVENT, min_size=30, max_size=80))
def test_with_session_growth_off_the_sessions_sizes_play_no_part(caps, groups, events):
    """session_growth=False: over random fleets, prefix groups and event orders, a placement told every
    session's size (place's prompt_tokens, observed()) decides exactly as one told none of them: same
    targets, same rule, same counters. Calls in flight count in both (they are in no engine figure yet)."""
    told, blind = (Placement(max_sessions=6, reopen_hint_s=0.0, session_growth=False) for _ in range(2))
    urls = URLS[:len(caps)]
    for p in (told, blind):
        p.set_engines([(u, True) for u in urls])
        p.set_capacity({u: [(c, 0, 0)] for u, c in zip(urls, caps) if c is not None}, 0.0)
    calls, now, healthy = [], 0.0, [True] * len(urls)
    for op, sid_n, x, size in events:
        now += 1.0
        sid = f"s{sid_n}"
        if op == "place":
            keys = group_keys(groups[sid_n], sid_n, x)
            a, b = told.place(sid, keys, now, prompt_tokens=size), blind.place(sid, keys, now)
            assert a == b and told.last_reason == blind.last_reason
            if a is not None:
                told.remember_prefix(keys, a)
                blind.remember_prefix(keys, b)
        elif op == "start" and sid in told._sessions:
            t = told._sessions[sid].target
            calls.append((t, told.call_started(t, size, now, sid), blind.call_started(t, size, now)))
        elif op == "finish" and calls:
            t, ha, hb = calls.pop(x % len(calls))
            told.call_finished(t, ha, now)
            blind.call_finished(t, hb, now)
        elif op == "observe":
            told.observed(sid, size)
        elif op == "forget":
            told.forget(sid, now)
            blind.forget(sid, now)
        elif op == "figures":
            u, c = urls[x % len(urls)], caps[x % len(urls)] or 10_000
            for p in (told, blind):
                p.set_capacity({u: [(c, min(size, c), 0)]}, now)
        elif op == "health":
            healthy[x % len(urls)] = not healthy[x % len(urls)]
            for p in (told, blind):
                p.set_engines(list(zip(urls, healthy)))
        elif op == "move":
            for p in (told, blind):
                p.move(sid, Target(urls[x % len(urls)]), now)
        assert told.counts == blind.counts
