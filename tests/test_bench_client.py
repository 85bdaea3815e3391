"""The bench's rollout client against a recording endpoint on 127.0.0.1: what a named and an unnamed client
send, and what it records from a streamed /v1/completions, /generate and chat answer."""

import orjson
from aiohttp import web

from kvgate.bench.runner import Recorder, send_turn
from kvgate.bench.speed import scale


async def test_named_and_unnamed_turns(aiohttp_client):
    seen = []

    async def completions(request):
        seen.append((dict(request.headers), await request.json()))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Kvgate-Session-Id": "kv-1"})
        await resp.prepare(request)
        for text in ("ab", "c"):
            await resp.write(b"data: " + orjson.dumps({"choices": [{"text": text}]}) + b"\n\n")
        usage = {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    client = await aiohttp_client(app)
    base = str(client.make_url("")).rstrip("/")
    rec = Recorder()
    scaled = scale(1.0, {}, 10.0, 1.0)
    ok, text = await send_turn(client.session, base, rec, "s1", 2, "hello", 3, scaled, named=True, api="completions")
    assert ok and text == "abc"
    headers, body = seen[0]
    # the named client asks for session affinity under smg's manual policy and names the request
    assert headers["X-Session-ID"] == "s1" and headers["X-SMG-Routing-Key"] == "s1"
    assert body["rid"] == "s1-turn2" and body["prompt"] == "hello" and body["max_tokens"] == 3 and body["stream"]
    r = rec.requests[0]
    assert (r["prompt_tokens"], r["output_tokens"], r["cached_tokens"], r["kv_session"]) == (5, 3, 4, "kv-1")
    assert r["ttft"] is not None and r["start"] <= r["ttft"] <= r["end"]

    ok, _ = await send_turn(client.session, base, rec, "s1", 3, "hello abc", 3, scaled, named=False, api="completions")
    headers, body = seen[1]
    assert ok and "X-Session-ID" not in headers and "X-SMG-Routing-Key" not in headers and "rid" not in body


async def test_generate_and_chat_turns(aiohttp_client):
    from kvgate.sim.tokenizer import encode
    seen = []

    async def generate(request):
        seen.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("ab", "abc"):  # cumulative, as SGLang streams /generate
            meta = {"prompt_tokens": 5, "completion_tokens": len(text), "cached_tokens": 4}
            await resp.write(b"data: " + orjson.dumps({"text": text, "meta_info": meta}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def chat(request):
        seen.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("x", "yz"):
            await resp.write(b"data: " + orjson.dumps({"choices": [{"delta": {"content": text}}]}) + b"\n\n")
        usage = {"prompt_tokens": 7, "completion_tokens": 3}
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/chat/completions", chat)
    client = await aiohttp_client(app)
    base = str(client.make_url("")).rstrip("/")
    rec = Recorder()
    scaled = scale(1.0, {}, 10.0, 1.0)
    ok, text = await send_turn(client.session, base, rec, "s1", 1, "hello", 3, scaled)
    assert ok and text == "abc"
    assert seen[0]["input_ids"] == encode("hello") and seen[0]["sampling_params"]["max_new_tokens"] == 3
    assert seen[0]["rid"] == "s1-turn1" and seen[0]["stream"] is True
    r = rec.requests[0]
    assert (r["prompt_tokens"], r["output_tokens"], r["cached_tokens"], r["prompt_len"]) == (5, 3, 4, 5)
    msgs = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "out"},
            {"role": "user", "content": "obs"}]
    ok, text = await send_turn(client.session, base, rec, "s1", 2, msgs, 3, scaled, api="chat")
    assert ok and text == "xyz" and seen[1]["messages"] == msgs and rec.requests[1]["prompt_len"] == 10


def test_router_command_per_arm(tmp_path):
    import pytest

    from kvgate.tools import procs
    from kvgate.bench.runner import Fleet, expand_arms
    from kvgate.bench.scenario import parse_scenario
    if not procs.smg_installed():
        pytest.skip("smg router not installed")
    sc = parse_scenario({"arms": ["direct", "router-limit"], "workload": {"kind": "agentic"}, "speed": 4,
                         "router_policy": "manual", "router_extra": ["--assignment-mode", "min_group"],
                         "router_limits": [8], "router_queue_timeout_s": 60})
    direct, limit8 = expand_arms(sc)
    scaled = scale(sc.speed, sc.kvgate_times, sc.router_queue_timeout_s, sc.sample_interval_s)
    f = Fleet(sc, direct, scaled, tmp_path)
    f.engine_urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    cmd = f.router_command(5, 6)
    assert cmd[cmd.index("--policy") + 1] == "manual"
    assert cmd[cmd.index("--assignment-mode") + 1] == "min_group"
    assert cmd[cmd.index("--load-monitor-interval") + 1] == "2"      # smg's 10 s at speed 4, whole seconds
    assert "--max-concurrent-requests" not in cmd
    f.arm = limit8
    cmd = f.router_command(5, 6)
    assert cmd[cmd.index("--max-concurrent-requests") + 1] == "8"
    assert cmd[cmd.index("--queue-timeout-secs") + 1] == "15"       # 60 s at speed 4
    assert "--assignment-mode" in cmd


def test_kvgate_router_extra_goes_only_to_the_arms_with_kvgate(tmp_path):
    """kvgate_router_extra (the router setup kvgate relies on) is added to smg's flags in kvgate's arms, never
    in smg-alone arms (direct, the sweep)."""
    import pytest

    from kvgate.tools import procs
    from kvgate.bench.runner import Fleet, expand_arms
    from kvgate.bench.scenario import parse_scenario
    if not procs.smg_installed():
        pytest.skip("smg router not installed")
    sc = parse_scenario({"arms": ["direct", "lifecycle"], "workload": {"kind": "agentic"},
                         "kvgate_router_extra": ["--decode-policy", "consistent_hashing"]})
    scaled = scale(sc.speed, sc.kvgate_times, sc.router_queue_timeout_s, sc.sample_interval_s)
    cmds = {}
    for arm in expand_arms(sc):
        f = Fleet(sc, arm, scaled, tmp_path)
        f.engine_urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        cmds[arm.name] = f.router_command(5, 6)
    assert "--decode-policy" not in cmds["direct"]
    lc = cmds["lifecycle"]
    assert lc[lc.index("--decode-policy") + 1] == "consistent_hashing"
    with pytest.raises(ValueError, match="kvgate_router_extra"):
        parse_scenario({"arms": ["direct"], "workload": {"kind": "agentic"}, "kvgate_router_extra": "x"})


def test_a_pd_scenario_starts_smg_in_pd_mode_and_is_checked(tmp_path):
    """prefill_engines > 0: smg gets --pd-disaggregation with each prefill worker's bootstrap port and the decode
    workers; a PD fleet needs simulated engines and no HiCache arm; the shipped pd-programs scenario parses."""
    import pytest

    from kvgate.tools import procs
    from kvgate.bench.runner import Fleet, expand_arms
    from kvgate.bench.scenario import load_scenario, parse_scenario
    if not procs.smg_installed():
        pytest.skip("smg router not installed")
    base = {"arms": ["direct"], "workload": {"kind": "agentic"}, "prefill_engines": 2, "engines": 3,
            "router_extra": ["--decode-policy", "consistent_hashing"]}
    sc = parse_scenario(base)
    (direct,) = expand_arms(sc)
    f = Fleet(sc, direct, scale(sc.speed, sc.kvgate_times, sc.router_queue_timeout_s, sc.sample_interval_s), tmp_path)
    f.prefill = [("http://127.0.0.1:1", 11), ("http://127.0.0.1:2", 12)]
    f.engine_urls = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3", "http://127.0.0.1:4",
                     "http://127.0.0.1:5"]
    cmd = f.router_command(5, 6)
    assert "--pd-disaggregation" in cmd and "--worker-urls" not in cmd
    i = cmd.index("--prefill")
    assert cmd[i:i + 6] == ["--prefill", "http://127.0.0.1:1", "11", "--prefill", "http://127.0.0.1:2", "12"]
    assert [cmd[j + 1] for j, x in enumerate(cmd) if x == "--decode"] == ["http://127.0.0.1:3", "http://127.0.0.1:4",
                                                                         "http://127.0.0.1:5"]
    assert cmd[cmd.index("--decode-policy") + 1] == "consistent_hashing"
    with pytest.raises(ValueError, match="prefill_engines: a PD fleet needs engine: sim"):
        parse_scenario({**base, "engine": "sglang", "speed": 1})
    with pytest.raises(ValueError, match="HiCache"):
        parse_scenario({**base, "arms": ["hicache"]})
    with pytest.raises(ValueError, match="prefill_engines: must be an integer >= 0"):
        parse_scenario({**base, "prefill_engines": -1})
    pd = load_scenario("configs/bench/pd-programs.yaml")
    assert (pd.prefill_engines, pd.engines) == (2, 6)
