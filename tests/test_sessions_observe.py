"""What the response observer records for every route and stream form (kvgate.sessions.observe)."""

import orjson

from kvgate.sessions.observe import ResponseObserver


def sse(*objs) -> bytes:
    return b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in objs) + b"data: [DONE]\n\n"


def chunk(content=None, finish=None, usage=None, calls=None, index=0):
    delta = {"role": "assistant"}
    if content is not None:
        delta["content"] = content
    if calls is not None:
        delta["tool_calls"] = calls
    out = {"choices": [{"index": index, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        out["usage"] = usage
    return out


def observe(route, body: bytes, is_sse=True, split=7):
    o = ResponseObserver(is_sse, route=route)
    for i in range(0, len(body), split):  # events straddle chunks
        o.feed(body[i:i + split])
    return o.result()


def test_chat_stream_without_usage_is_counted_per_content_chunk():
    body = sse(chunk(""), *(chunk(t) for t in ("He", "llo", " wor", "ld")), chunk("", finish="stop"))
    r = observe("/v1/chat/completions", body)
    assert r.meta_info == {"completion_tokens": 4} and r.usage_source == "counted"
    assert r.output == "\x02assistant\x03Hello world\x04" and r.finish_type == "stop"


def test_chat_stream_usage_block_wins_final_or_continuous():
    usage = {"prompt_tokens": 30, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 29}}
    final = sse(chunk("a"), chunk("b", finish="length"), {"choices": [], "usage": usage})
    r = observe("/v1/chat/completions", final)
    assert r.meta_info == {"prompt_tokens": 30, "completion_tokens": 2, "cached_tokens": 29}
    assert r.usage_source == "usage" and r.finish_type == "length"
    # continuous_usage_stats: cumulative usage on every chunk, the last one counts
    cont = sse(chunk("a", usage={"prompt_tokens": 30, "completion_tokens": 1}),
               chunk("b", finish="stop", usage={"prompt_tokens": 30, "completion_tokens": 2}))
    assert observe("/v1/chat/completions", cont).meta_info == {"prompt_tokens": 30, "completion_tokens": 2}


def test_generate_stream_ending_with_an_error_event_keeps_the_last_meta_info():
    meta = {"prompt_tokens": 10, "completion_tokens": 3, "cached_tokens": 0, "finish_reason": None}
    body = sse({"text": "abc", "output_ids": [1, 2, 3], "meta_info": meta}, {"error": {"message": "boom"}})
    r = observe("/generate", body)
    assert r.meta_info["completion_tokens"] == 3 and r.usage_source == "meta_info"


def test_responses_api_usage_stream_and_json():
    done = {"type": "response.completed", "response": {"usage": {
        "input_tokens": 12, "output_tokens": 5, "input_tokens_details": {"cached_tokens": 8}}}}
    r = observe("/v1/responses", sse({"type": "response.output_text.delta", "delta": "x"}, done))
    assert r.meta_info == {"prompt_tokens": 12, "completion_tokens": 5, "cached_tokens": 8}
    j = orjson.dumps({"output": [], "usage": {"input_tokens": 7, "output_tokens": 2}})
    assert observe("/v1/responses", j, is_sse=False).meta_info == {"prompt_tokens": 7, "completion_tokens": 2}


def test_tool_call_with_null_index_or_odd_fields_never_raises():
    calls = [{"index": None, "id": "c1", "function": {"name": "ls", "arguments": None}},
             {"index": "x", "function": {"name": 3, "arguments": "{}"}}]
    r = observe("/v1/chat/completions", sse(chunk(calls=calls), chunk("", finish="tool_calls")))
    assert r.meta_info == {"completion_tokens": 1} and r.finish_type == "tool_calls"
    assert r.output == '\x02assistant\x03[["ls",{}]]\x04'
