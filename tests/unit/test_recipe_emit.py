"""The API emitters and the per-request driver, without the oracle: lifecycle, framing, the Completions API
(which has no oracle), chat-template models and the edges of the complete responses."""

from __future__ import annotations

import json
from typing import Any

import orjson

from services.recipe.emit import End, OutputProcessor, Ready, Text, Tokens
from services.recipe.emit.base import parse_arguments
from services.recipe.parse import TokenTable
from services.recipe.prepared import InferenceSpec, ParsingSpec, PreparedRequest

TOOL = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="ns__f">\n<｜DSML｜parameter name="a" string="true">x'
        "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
TABLE = TokenTable(token_bytes=(b"Hi", b" there", b"!"), added={}, eos_ids=frozenset({3}))


def prepared(api: str = "chat", *, stream: bool = True, encoding: str = "v4", include_usage: bool = False,
             **parsing: Any) -> PreparedRequest:
    return PreparedRequest(api=api, model="m", encoding=encoding, stream=stream,  # type: ignore[arg-type]
                           include_usage=include_usage, conversation=None, inference=InferenceSpec(None, None, None),
                           parsing=ParsingSpec(**parsing), echo={}, extra={})


def processor(p: PreparedRequest, **kw: Any) -> OutputProcessor:
    return OutputProcessor(p, response_id="rid", created=7, count_tokens=len, **kw)


def data(events: list[tuple[str | None, bytes]]) -> list[dict[str, Any]]:
    return [orjson.loads(d) for _, d in events]


def test_chat_stream_frames_end_with_done() -> None:
    p = processor(prepared(thinking_initial_stage="reasoning_start"))
    frames = p.frames(p.push(Ready(10, 4)))
    assert frames[0].startswith(b"data: {") and frames[0].endswith(b"}\n\n")
    frames += p.frames(p.push(Text("hmm</think>ok", 3)))
    last = p.frames(p.push(End("length")))
    assert last[-1] == b"data: [DONE]\n\n" and p.done
    chunk = json.loads(last[-2][len(b"data: "):])
    assert chunk["choices"][0]["finish_reason"] == "length"
    assert chunk["usage"]["completion_tokens"] == 3 and chunk["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": 3}  # count_tokens=len here: len("hmm")
    assert chunk["usage"]["prompt_cache_hit_tokens"] == 4 and chunk["usage"]["prompt_cache_miss_tokens"] == 6
    assert all(b'"usage"' not in f for f in frames)  # no include_usage: only the final chunk has usage


def test_include_usage_puts_a_null_usage_on_every_chunk() -> None:
    p = processor(prepared(include_usage=True))
    events = p.push(Ready(1)) + p.push(Text("a", 1)) + p.finish()
    assert [d["usage"] is None for d in data(events)] == [True, True, False]


def test_messages_frames_are_named() -> None:
    p = processor(prepared("messages"))
    frames = p.frames(p.push(Ready(1)) + p.push(Text("hi", 1)) + p.push(End("stop")))
    names = [f.split(b"\n", 1)[0] for f in frames]
    assert names == [b"event: message_start", b"event: content_block_start", b"event: ping",
                     b"event: content_block_delta", b"event: content_block_stop", b"event: message_delta",
                     b"event: message_stop"]


def test_the_end_of_sentence_token_ends_the_turn_and_later_chunks_are_ignored() -> None:
    p = processor(prepared(parse_tool_calls=False), tokens=TABLE)
    p.push(Ready(2))
    events = p.push(Tokens([0, 1, 3, 2]))
    assert p.done and p.finish_reason == "stop"
    assert [d["choices"][0]["delta"].get("content") for d in data(events)] == ["Hi there", ""]
    assert p.push(Tokens([2])) == [] and p.push(End("length")) == [] and p.finish() == []
    body = orjson.loads(p.body())
    assert body["choices"][0]["message"]["content"] == "Hi there"
    assert body["usage"]["completion_tokens"] == 3  # "!" after the end is not counted


def test_a_stop_sequence_asks_the_engine_to_cancel() -> None:
    p = processor(prepared("messages", stop_sequences=["STOP"]))
    p.push(Ready(1))
    p.push(Text("one STOP two", 2))
    assert p.done and p.stopped and p.finish_reason == "stop_sequence"
    body = orjson.loads(p.body())
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "STOP"
    assert body["content"] == [{"type": "text", "text": "one "}]


def test_tool_calls_finish_only_on_the_backends_stop() -> None:
    for end, reason in ((End("stop"), "tool_calls"), (End("length"), "length"), (None, "stop")):
        p = processor(prepared(stream=False))
        p.push(Text(TOOL, 9))
        if end is not None:
            p.push(end)
        p.finish()
        message = orjson.loads(p.body())["choices"][0]
        assert message["finish_reason"] == reason
        assert json.loads(message["message"]["tool_calls"][0]["function"]["arguments"]) == {"a": "x"}


def test_chat_template_models_are_plain_text() -> None:
    p = processor(prepared(encoding="chat_template", thinking_initial_stage="reasoning_start",
                           stop_sequences=["<|im_end|>"], stream=False))
    p.push(Ready(3))
    p.push(Text("\n<think>x</think>" + TOOL + "<|im_end|>after", 5))
    message = orjson.loads(p.body())["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "\n<think>x</think>" + TOOL}


def test_chat_template_models_skip_control_tokens() -> None:
    table = TokenTable(token_bytes=(b"Hi", b" there", b"<|im_start|>", b"<x>", b"<|im_end|>"),
                       added={2: ("\udcff", "<|im_start|>"), 3: ("\udcff", "<x>"), 4: ("\udcff", "<|im_end|>")},
                       eos_ids=frozenset({4}), special_ids=frozenset({2, 4}))
    p = processor(prepared(encoding="chat_template", stream=False), tokens=table)
    p.push(Ready(3))
    p.push(Tokens([0, 2, 1, 3, 4, 0]))
    body = orjson.loads(p.body())
    assert body["choices"][0]["message"]["content"] == "Hi there<x>"  # a user-defined added token is text
    assert body["usage"]["completion_tokens"] == 5


def test_completions_stream_and_body() -> None:
    p = processor(prepared("completions", include_usage=True, stop_sequences=["\n\n"],
                           thinking_initial_stage="reasoning_start"))
    events = p.push(Ready(5, 1)) + p.push(Text("Once</think> upon", 2)) + p.push(Text(" a time\n\nThe end", 3))
    chunks = data(events)
    assert [c["choices"] for c in chunks[:-1]] == [
        [{"index": 0, "text": "Once</think> upon", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": " a time", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}],
    ]
    assert chunks[0]["object"] == "text_completion" and chunks[0]["id"] == "rid" and chunks[0]["usage"] is None
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 1}}
    assert p.frames(p.finish()) == []
    body = orjson.loads(p.body())
    assert body["choices"] == [{"index": 0, "text": "Once</think> upon a time", "logprobs": None,
                                "finish_reason": "stop"}]


def test_responses_namespaced_tools_and_echo() -> None:
    p = OutputProcessor(
        PreparedRequest(api="responses", model="m", encoding="v4", stream=False, include_usage=False,
                        conversation=None, inference=InferenceSpec(None, None, None), parsing=ParsingSpec(),
                        echo={"instructions": "be brief", "top_p": 0.5, "unknown": 1},
                        extra={"namespace_tool_map": {"ns__f": ("ns", "f")}}),
        response_id="resp_1", created=7)
    p.push(Ready(2))
    p.push(Text(TOOL, 4))
    p.push(End("stop"))
    body = orjson.loads(p.body())
    assert body["status"] == "completed" and body["instructions"] == "be brief" and body["top_p"] == 0.5
    assert "unknown" not in body
    call = body["output"][0]
    assert (call["id"], call["name"], call["namespace"], call["arguments"]) == ("fc_resp_1_0", "f", "ns", '{"a": "x"}')


def test_tool_arguments_for_the_messages_response() -> None:
    assert parse_arguments('{"a": 1e5, "b": -0.0, "a": 2}') == {"a": 2, "b": -0.0}
    assert parse_arguments('{"big": 123456789012345678901234}') == {"big": 1.2345678901234568e23}
    assert parse_arguments('{"a": "x"') == {} and parse_arguments("[1]") == {}
    assert parse_arguments('{"a": NaN}') == {} and parse_arguments('{"a": 1e999}') == {}
