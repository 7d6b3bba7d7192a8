"""API adapters: validation errors (status + each API's error JSON), and response/stream formats checked against
the official SDKs' own types."""

from __future__ import annotations

from typing import Any

import orjson
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.recipe.apis import APIS, ApiError, ChatRequest, Finish, Usage

MODEL = "SmolLM2-135M-Instruct"
chat_api, messages_api = APIS["chat"], APIS["messages"]


def _chat(**overrides: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **overrides}


def _msgs(**overrides: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}], **overrides}


def _refusal(api: Any, body: Any) -> tuple[int, dict[str, Any]]:
    with pytest.raises(ApiError) as info:
        api.parse(body)
    return info.value.status, orjson.loads(info.value.body)


# --- OpenAI Chat Completions ---------------------------------------------------------------------------------


def test_openai_valid_request_is_normalized() -> None:
    req = chat_api.parse(_chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ],
        max_completion_tokens=32, max_tokens=8, temperature=0, top_p=0.5, seed=42, stop="END",
        stream=True, stream_options={"include_usage": True}, presence_penalty=0.0, n=1,
    ))
    assert req == ChatRequest(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
                  {"role": "assistant", "content": ""}],
        max_tokens=32, temperature=0.0, top_p=0.5, seed=42, stop=("END",), stream=True, include_usage=True,
    )
    assert chat_api.parse(_chat()).max_tokens is None  # unset: the service fills the rest of the context


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ([1, 2], None, "expected an object"),
        (_chat(model=None), "model", "required"),
        (_chat(model=7), "model", "string"),
        ({"model": MODEL}, "messages", "required"),
        (_chat(messages="hi"), "messages", "array"),
        (_chat(messages=[]), "messages", "at least one"),
        (_chat(messages=[{"role": "robot", "content": "x"}]), "messages.0.role", "robot"),
        (_chat(messages=[{"role": "user"}]), "messages.0.content", "string"),
        (_chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages.0.content.0.type", "text"),
        (_chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), "messages.0.role", "tool"),
        (_chat(max_tokens="10"), "max_tokens", "integer"),
        (_chat(max_tokens=0), "max_tokens", "range"),
        (_chat(max_completion_tokens=True), "max_completion_tokens", "integer"),
        (_chat(temperature=2.5), "temperature", "range"),
        (_chat(temperature="hot"), "temperature", "number"),
        (_chat(top_p=0), "top_p", "range"),
        (_chat(top_p=1.5), "top_p", "range"),
        (_chat(n=2), "n", "n=1"),
        (_chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
        (_chat(stop=[1]), "stop", "string"),
        (_chat(stream="yes"), "stream", "boolean"),
        (_chat(stream_options={"include_usage": True}), "stream_options", "stream"),
        (_chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "not supported"),
        (_chat(logprobs=True), "logprobs", "not supported"),
        (_chat(response_format={"type": "json_object"}), "response_format", "text"),
        (_chat(seed=2**70), "seed", "range"),
    ],
)
def test_openai_rejects_bad_requests(body: Any, param: str | None, fragment: str) -> None:
    status, err = _refusal(chat_api, body)
    assert status == 400
    assert set(err) == {"error"}
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["param"] == param
    assert fragment in err["error"]["message"]


def test_openai_special_errors() -> None:
    err = chat_api.model_not_found("gpt-9")
    assert err.status == 404
    assert orjson.loads(err.body)["error"] == {
        "message": "The model `gpt-9` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found",
    }
    too_long = orjson.loads(chat_api.too_long(8000, 500, 8192).body)["error"]
    assert too_long["code"] == "context_length_exceeded" and "8500" in too_long["message"]
    assert orjson.loads(chat_api.error(503, "busy").body)["error"]["type"] == "server_error"


# --- Anthropic Messages --------------------------------------------------------------------------------------


def test_anthropic_valid_request_is_normalized() -> None:
    req = messages_api.parse(_msgs(
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Count", "cache_control": {}}]},
                  {"role": "assistant", "content": "1, 2,"}],
        temperature=0.2, top_k=40, stop_sequences=["\n\n"], stream=True, thinking={"type": "disabled"},
    ))
    assert req == ChatRequest(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count"},
                  {"role": "assistant", "content": "1, 2,"}],
        max_tokens=16, temperature=0.2, top_k=40, stop=("\n\n",), stream=True, include_usage=True,
        continue_final=True,
    )


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("[]", "expected an object"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model: field required"),
        (_msgs(max_tokens=None), "max_tokens: field required"),
        (_msgs(max_tokens=-1), "max_tokens"),
        (_msgs(max_tokens=1.5), "max_tokens: expected an integer"),
        (_msgs(messages=[]), "at least one"),
        (_msgs(messages={"role": "user"}), "array"),
        (_msgs(messages=[{"role": "system", "content": "x"}]), "messages.0.role"),
        (_msgs(messages=[{"role": "user"}]), "messages.0.content: field required"),
        (_msgs(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "'image'"),
        (_msgs(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content.0.text"),
        (_msgs(system=5), "system"),
        (_msgs(temperature=1.5), "temperature"),
        (_msgs(top_p=-0.1), "top_p"),
        (_msgs(top_k=-1), "top_k"),
        (_msgs(stop_sequences="END"), "stop_sequences"),
        (_msgs(tools=[{"name": "f", "input_schema": {}}]), "tools"),
        (_msgs(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
        (_msgs(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y "}]), "whitespace"),
    ],
)
def test_anthropic_rejects_bad_requests(body: Any, fragment: str) -> None:
    status, err = _refusal(messages_api, body)
    assert status == 400
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert fragment in err["error"]["message"]


def test_anthropic_special_errors() -> None:
    err = messages_api.model_not_found("claude-9")
    assert err.status == 404
    assert orjson.loads(err.body) == {
        "type": "error", "error": {"type": "not_found_error", "message": "model: claude-9"}
    }
    assert "exceed context limit" in messages_api.too_long(8000, 500, 8192).message
    assert orjson.loads(messages_api.error(503, "busy").body)["error"]["type"] == "overloaded_error"


# --- formats -------------------------------------------------------------------------------------------------

USAGE = Usage(prompt_tokens=20, completion_tokens=3, cached_tokens=16)


def _sse_data(frames: list[bytes]) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) per frame; every frame is one complete SSE event."""
    out = []
    for frame in frames:
        assert frame.endswith(b"\n\n") and frame.count(b"\n\n") == 1
        lines = dict(line.split(b": ", 1) for line in frame.strip().split(b"\n"))
        data = lines[b"data"]
        out.append((lines.get(b"event", b"").decode() or None, data if data == b"[DONE]" else orjson.loads(data)))
    return out


def test_openai_stream_frames_are_sdk_chunks() -> None:
    req = chat_api.parse(_chat(stream=True, stream_options={"include_usage": True}))
    w = chat_api.writer("r1", req, 1700000000)
    frames = w.start(USAGE) + w.delta("Hel") + w.delta("") + w.delta("lo") + w.finish(Finish("length"), USAGE)
    events = _sse_data(frames)
    assert events[-1] == (None, b"[DONE]")
    chunks = [ChatCompletionChunk.model_validate(data) for _, data in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == 23 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 16
    assert {c.id for c in chunks} == {"chatcmpl-r1"}


def test_openai_body_is_an_sdk_completion() -> None:
    req = chat_api.parse(_chat())
    body = chat_api.writer("r2", req, 1700000000).body("Paris.", Finish("stop_string", "\n"), USAGE)
    completion = ChatCompletion.model_validate(orjson.loads(body))
    assert completion.choices[0].message.content == "Paris."
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens == 3
    assert _sse_data(chat_api.writer("r2", req, 0).error_frames(chat_api.error(503, "down")))[0][1]["error"]


def test_anthropic_stream_frames_are_sdk_events() -> None:
    req = messages_api.parse(_msgs(stream=True))
    w = messages_api.writer("r3", req, 0)
    frames = w.start(USAGE) + w.delta("Hi") + w.delta(" there") + w.finish(Finish("stop_string", "END"), USAGE)
    adapter = pydantic.TypeAdapter(RawMessageStreamEvent)
    events = [(name, adapter.validate_python(data)) for name, data in _sse_data(frames)]
    assert [name for name, _ in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]
    assert all(name == ev.type for name, ev in events)
    start, delta = events[0][1], events[5][1]
    assert start.message.usage.input_tokens == 4 and start.message.usage.cache_read_input_tokens == 16
    assert delta.delta.stop_reason == "stop_sequence" and delta.delta.stop_sequence == "END"
    assert delta.usage.output_tokens == 3
    assert "".join(ev.delta.text for name, ev in events if name == "content_block_delta") == "Hi there"
    error = _sse_data(w.error_frames(messages_api.error(503, "down")))
    assert error[0][0] == "error" and error[0][1]["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize(("reason", "expected"), [("stop", "end_turn"), ("length", "max_tokens")])
def test_anthropic_body_is_an_sdk_message(reason: str, expected: str) -> None:
    req = messages_api.parse(_msgs())
    body = messages_api.writer("r4", req, 0).body("Hello!", Finish(reason), USAGE)
    message = Message.model_validate(orjson.loads(body))
    assert message.id == "msg_r4" and message.content[0].text == "Hello!"  # type: ignore[union-attr]
    assert message.stop_reason == expected and message.stop_sequence is None
    assert message.usage.output_tokens == 3


@pytest.mark.parametrize("api", [chat_api, messages_api])
@pytest.mark.parametrize(
    "messages",
    [[{"role": {"x": 1}, "content": "x"}], [{"role": ["user"], "content": "x"}], [None], ["hi"],
     [{"role": "user", "content": [None]}], [{"role": "user", "content": {"type": "text"}}]],
)
def test_odd_json_shapes_are_refused_not_crashed(api: Any, messages: Any) -> None:
    status, _ = _refusal(api, {"model": MODEL, "max_tokens": 5, "messages": messages})
    assert status == 400
