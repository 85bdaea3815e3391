"""The session observer on OpenAI streams as SGLang writes them: tool calls, null indexes, n > 1 (pure)."""

import orjson

from kvgate.sessions.inference import chat_output_text
from kvgate.sessions.observe import ResponseObserver


def _chunk(delta=None, index=0, finish=None, **extra):
    """One chat.completion.chunk with the fields SGLang's ChatCompletionStreamResponse writes."""
    choice = {"index": index, "delta": {"role": None, "content": None, "reasoning_content": None,
                                        "tool_calls": None, **(delta or {})},
              "logprobs": None, "finish_reason": finish, "matched_stop": None}
    return {"id": "c-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice],
            "usage": None, **extra}


def _call(index, call_id=None, name=None, arguments=""):
    return {"id": call_id, "index": index, "type": "function", "function": {"name": name, "arguments": arguments}}


def _stream(chunks) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _observe(chunks, step=11) -> ResponseObserver:
    o = ResponseObserver(is_sse=True, route="/v1/chat/completions", prompt_is_text=True)
    raw = _stream(chunks)
    for i in range(0, len(raw), step):  # events straddle the relay's chunks
        o.feed(raw[i:i + step])
    return o


def test_tool_call_stream_with_null_index_is_read_not_raised():
    chunks = [
        _chunk({"role": "assistant", "content": "Let me look."}),
        _chunk({"tool_calls": [_call(0, "call_a", "ls", "")]}),
        _chunk({"tool_calls": [_call(None, arguments='{"path": ')]}),   # index null: extends call 0
        _chunk({"tool_calls": [_call(None, arguments='"/tmp"}')]}),
        _chunk({"tool_calls": [_call(None, "call_b", "cat", '{"f": 1}')]}),  # a new id with a null index
        _chunk({"tool_calls": [{"function": {"arguments": "", "name": None}}]}),  # no index at all
        _chunk(finish="tool_calls"),
    ]
    got = _observe(chunks).result()
    assert got.finish_type == "tool_calls"
    assert got.output == chat_output_text({"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "ls", "arguments": '{"path": "/tmp"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "cat", "arguments": '{"f": 1}'}}]})


def test_odd_tool_call_fields_never_raise():
    chunks = [
        _chunk({"tool_calls": [_call("0", "x", "f", "a")]}),        # a string index
        _chunk({"tool_calls": [_call(True, arguments=7)]}),          # a bool index, a number as arguments
        _chunk({"tool_calls": {"index": 0}}),                        # tool_calls not a list
        _chunk({"tool_calls": [None, 3, {"index": 0, "function": "f"}]}),
        {"choices": "nope"}, {"choices": [None]}, [1, 2], "text",
        _chunk(finish="stop"),
    ]
    got = _observe(chunks, step=5).result()
    assert got.finish_type == "stop"
    assert got.output == chat_output_text({"role": "assistant", "content": "", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "a"}}]})


def test_n_greater_than_one_keeps_the_first_sequence_only():
    chunks = []
    for i, text in ((0, "ab"), (1, "XY"), (0, "c"), (1, "Z")):
        chunks.append(_chunk({"role": "assistant", "content": text}, index=i))
    chunks += [_chunk(index=0, finish="length"), _chunk(index=1, finish="stop")]
    got = _observe(chunks).result()
    assert got.output == chat_output_text({"role": "assistant", "content": "abc"})
    assert got.finish_type == "length"


def test_usage_chunk_at_the_end_gives_the_token_counts():
    chunks = [_chunk({"content": "hi"}), _chunk(finish="stop"),
              {"id": "c-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
               "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14,
                         "prompt_tokens_details": {"cached_tokens": 8}}}]
    got = _observe(chunks).result()
    assert got.meta_info == {"prompt_tokens": 12, "completion_tokens": 2, "cached_tokens": 8}
    assert got.finish_type == "stop" and got.output == "\x02assistant\x03hi\x04"


def test_a_message_orjson_cannot_write_is_rendered_not_raised():
    deep: list = []
    for _ in range(300):  # orjson writes at most 254 levels
        deep = [deep]
    msg = {"role": "assistant", "content": "x", "tool_calls": [{"function": {"arguments": deep}}]}
    assert chat_output_text(msg).startswith("\x02assistant\x03x[[None, [[")
    o = ResponseObserver(is_sse=False, route="/v1/chat/completions", prompt_is_text=True)
    o.feed(b'{"choices":[{"message":{"content":"x","tool_calls":[{"a":' + b"[" * 300 + b"]" * 300 + b"}]}}]}")
    assert o.result().output.startswith("\x02assistant\x03x[{'a'")
