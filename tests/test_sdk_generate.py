"""/generate token-id calls the way RL frameworks send them, through kvgate (lifecycle + admission on) ->
real smg -> a simulated engine, each answer compared with the same call straight at smg.

The payloads follow what the frameworks' rollout code sends (docs/integrations.md names the files):
slime (input_ids + return_logprob, the session as X-SMG-Routing-Key), Relax (a top-level session_id and a
rid), AReaL (no session at all: kvgate infers it from the prompt's prefix), plus the batch form, n > 1 and
streaming.
"""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from conftest import CloseWatcher
from sdk_fleet import fleet, metric, settled  # noqa: F401 (fleet is a fixture)

pytestmark = pytest.mark.router

# slime's sampling params with its deterministic-inference seed: the same prompt samples the same tokens
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 16, "no_stop_trim": True,
            "spaces_between_special_tokens": False, "skip_special_tokens": False, "sampling_seed": 1234}


def _prompt(n: int, first: int = 40) -> list[int]:
    return [first + (i * 7) % 90 for i in range(n)]  # byte-range ids the simulator decodes to text


async def _post(http, url, body, headers=None):
    async with http.post(url + "/generate", data=orjson.dumps(body),
                         headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, orjson.loads(await r.read()), r.headers


def _same(got: dict, want: dict, n_new: int) -> None:
    """The answer an RL trainer keeps: text, ids, per-token logprobs, finish reason and token counts."""
    assert got["text"] == want["text"] and got["output_ids"] == want["output_ids"]
    g, w = got["meta_info"], want["meta_info"]
    assert g["output_token_logprobs"] == w["output_token_logprobs"]
    assert [t for _, t, _ in g["output_token_logprobs"]] == got["output_ids"]  # slime reads ids from here
    assert (g["finish_reason"], g["prompt_tokens"], g["completion_tokens"]) == \
        (w["finish_reason"], w["prompt_tokens"], w["completion_tokens"])
    assert g["completion_tokens"] == len(got["output_ids"]) == n_new


async def test_slime_style_turns_keyed_by_the_routing_key_header(fleet):
    # slime sends its per-sample session as X-SMG-Routing-Key (router_policy consistent_hashing);
    # kvgate takes the session from that header when told to.
    f = await fleet(session_header="X-SMG-Routing-Key")
    prompt = _prompt(300)
    key = {"X-SMG-Routing-Key": "sample-0"}
    async with aiohttp.ClientSession() as http:
        turns = []
        for turn in range(2):
            body = {"input_ids": prompt, "sampling_params": SAMPLING, "return_logprob": True}
            st, got, headers = await _post(http, f.kv, body, key)
            st2, want, _ = await _post(http, f.router, body, key)
            assert (st, st2) == (200, 200)
            _same(got, want, 16)
            assert headers["X-Kvgate-Session-Id"] == "sample-0" and headers["X-Kvgate-Admission"] == "admit"
            turns.append(got)
            prompt = prompt + got["output_ids"] + _prompt(20, first=60)  # the tool's answer, as tokens
    # turn 1's prompt and output stayed cached, less the last output token (sampled, never run through the model)
    assert turns[1]["meta_info"]["cached_tokens"] == 300 + 16 - 1
    s = await settled(f, "sample-0", 2)
    assert (s.source, s.prompt_tokens, s.completion_tokens) == ("header", 300 + 336, 32)
    assert [t for _, t in f.reservations] == [300 + 16, 336 + 16]  # prompt + max_new_tokens, exactly


async def test_relax_style_session_id_in_the_body_then_closed_on_every_engine(fleet):
    f = await fleet()
    closes = CloseWatcher(f.engine)
    prompt = _prompt(200)
    async with aiohttp.ClientSession() as http:
        body = {"input_ids": prompt, "sampling_params": SAMPLING, "rid": "req-1", "return_logprob": True,
                "session_id": "relax-s1"}
        st, got, headers = await _post(http, f.kv, body)
        st2, want, _ = await _post(http, f.router, body)
        assert (st, st2) == (200, 200)
        _same(got, want, 16)
        # Relax closes sessions itself: it lists the workers at its router URL and posts to each one.
        async with http.get(f.kv + "/workers") as r:
            via_kv = [w["url"] for w in (await r.json())["workers"]]
        async with http.get(f.router + "/workers") as r:
            direct = [w["url"] for w in (await r.json())["workers"]]
        assert via_kv == direct == [f.worker.url]
        # ... and kvgate's own /close_session does the same fan-out when the client asks it instead.
        async with http.post(f.kv + "/close_session", json={"session_id": "relax-s1"}) as r:
            assert r.status == 200 and await r.json() == {"session_id": "relax-s1", "known": True,
                                                          "state": "closing", "engines": 1}
        await closes.wait_for("relax-s1")
    s = await settled(f, "relax-s1", 1)
    assert s.source == "body" and s.completion_tokens == 16
    assert closes.ids == ["relax-s1"]
    # smg 1.13 forwards session_id on /generate: the engine saw it on both requests (kvgate's and the direct one)
    assert [b.get("session_id") for b in f.worker.bodies("/generate")] == ["relax-s1", "relax-s1"]
    assert [b["rid"] for b in f.worker.bodies("/generate")] == ["req-1", "req-1"]
    assert [b["return_logprob"] for b in f.worker.bodies("/generate")] == [True, True]


async def test_areal_style_no_session_at_all_is_inferred_from_the_prefix(fleet):
    f = await fleet()
    prompt = _prompt(256)
    async with aiohttp.ClientSession() as http:
        sids = []
        for turn in range(3):
            body = {"input_ids": prompt, "image_data": None, "sampling_params": {**SAMPLING, "stop_token_ids": []},
                    "return_logprob": True, "stream": False}
            st, got, headers = await _post(http, f.kv, body)
            st2, want, _ = await _post(http, f.router, body)
            assert (st, st2) == (200, 200)
            _same(got, want, 16)
            sids.append(headers["X-Kvgate-Session-Id"])
            prompt = prompt + got["output_ids"] + _prompt(30, first=50 + turn)
    assert len(set(sids)) == 1 and sids[0].startswith("inf-")
    s = await settled(f, sids[0], 3)
    assert s.source == "inferred" and s.completion_tokens == 48
    assert metric(f, 'agentic_kv_session_inference_total{result="new"}') == 1
    assert metric(f, 'agentic_kv_session_inference_total{result="decisive"}') == 2


async def test_batch_form_and_n_greater_than_one(fleet):
    f = await fleet()
    prompts = [_prompt(120, first=41), _prompt(90, first=45), _prompt(150, first=52)]
    async with aiohttp.ClientSession() as http:
        batch = {"input_ids": prompts, "sampling_params": {**SAMPLING, "max_new_tokens": 8}, "return_logprob": True}
        st, got, _ = await _post(http, f.kv, batch, {"X-Session-ID": "batch-1"})
        st2, want, _ = await _post(http, f.router, batch)
        assert (st, st2) == (200, 200) and len(got) == len(want) == 3
        for g, w, p in zip(got, want, prompts):
            _same(g, w, 8)
            assert g["meta_info"]["prompt_tokens"] == len(p)
        n2 = {"input_ids": prompts[0], "sampling_params": {**SAMPLING, "n": 2}, "return_logprob": True}
        st, got_n, _ = await _post(http, f.kv, n2, {"X-Session-ID": "n-1"})
        st2, want_n, _ = await _post(http, f.router, n2)
        assert (st, st2) == (200, 200) and len(got_n) == len(want_n) == 2
        for g, w in zip(got_n, want_n):
            _same(g, w, 16)
    s = await settled(f, "batch-1", 1)
    assert (s.prompt_tokens, s.completion_tokens) == (360, 24)  # the batch's sequences summed
    s = await settled(f, "n-1", 1)
    assert (s.prompt_tokens, s.completion_tokens) == (240, 32)
    # every sequence reserved: batch = sum(prompt + 8); n copies share their prompt (SGLang prefills it once):
    # prompt + 2 x 16
    assert [t for _, t in f.reservations] == [360 + 3 * 8, 120 + 2 * 16]
    assert f.gw.gate.ledger.reserved == 0


async def test_stream_with_logprobs_relays_every_event(fleet):
    f = await fleet()
    body = {"input_ids": _prompt(180), "sampling_params": {**SAMPLING, "max_new_tokens": 24},
            "return_logprob": True, "stream": True}

    async def events(url, headers=None):
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/generate", json=body, headers=headers or {}) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                raw = await r.read()
        assert raw.endswith(b"data: [DONE]\n\n")
        return [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]

    got = await events(f.kv, {"X-Session-ID": "stream-1"})
    want = await events(f.router)
    assert [e["text"] for e in got] == [e["text"] for e in want] and len(got) >= 2
    _same(got[-1], want[-1], 24)
    # each event is cumulative: its logprobs cover exactly the ids so far
    assert all(len(e["meta_info"]["output_token_logprobs"]) == len(e["output_ids"]) for e in got)
    s = await settled(f, "stream-1", 1)
    assert (s.prompt_tokens, s.completion_tokens) == (180, 24)
