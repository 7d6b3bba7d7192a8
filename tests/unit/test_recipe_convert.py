"""API requests -> PreparedRequest: the conversion rules, without the oracle (tests/oracle/ compares with it)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from services.recipe.convert import ConvertOptions, convert
from services.recipe.convert.limits import resolve_max_tokens
from services.recipe.errors import ConversionError, api_error

PRO, FLASH = "DeepSeek-V4-Pro", "DeepSeek-V4.1-Flash"
USER = {"role": "user", "content": "hi"}


def chat(**body: Any) -> Any:
    return convert("chat", json.dumps({"model": PRO, "messages": [USER], **body}).encode())


def refusal(api: str, body: Any) -> tuple[int, str]:
    with pytest.raises(ConversionError) as info:
        convert(api, body if isinstance(body, bytes) else json.dumps(body).encode())
    return info.value.status, info.value.message


def test_thinking_is_on_by_default_with_high_effort_and_forced_sampling() -> None:
    p = chat(temperature=0.2, top_p=0.5)
    assert p.encoding == "v4" and p.conversation.thinking and p.conversation.reasoning_effort == "high"
    assert (p.inference.temperature, p.inference.top_p, p.inference.max_tokens) == (1.0, 1.0, None)
    assert p.parsing.thinking_initial_stage == "reasoning_start"


def test_without_thinking_the_sampling_is_the_clients_as_f32() -> None:
    p = chat(thinking={"type": "disabled"}, temperature=0.3, top_p=0.5, seed=7, stop="END")
    assert p.inference.temperature == pytest.approx(0.3) and p.inference.temperature != 0.3  # f32, as the reference
    assert (p.inference.top_p, p.inference.seed, p.parsing.stop_sequences) == (0.5, 7, ["END"])
    assert p.parsing.thinking_initial_stage is None and p.conversation.reasoning_effort is None


def test_top_p_per_model_version_in_thinking_mode() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat(tools=tools).inference.top_p == pytest.approx(0.95)  # V4 thinking with tools
    flash = convert("chat", json.dumps({"model": FLASH, "messages": [USER], "top_p": 0.5}).encode())
    assert flash.encoding == "v41" and flash.inference.top_p == pytest.approx(0.95)  # V4.1 floor


@pytest.mark.parametrize(("effort", "expected"), [("minimal", "low"), ("medium", "high"), ("ultra", "max"),
                                                  ("xhigh", "xhigh")])
def test_api_efforts_map_onto_the_formats_efforts(effort: str, expected: str) -> None:
    assert chat(reasoning_effort=effort).conversation.reasoning_effort == expected


def test_effort_none_turns_thinking_off_unless_thinking_is_asked_for() -> None:
    assert not chat(reasoning_effort="none").conversation.thinking
    assert chat(reasoning_effort="none", thinking={"type": "enabled"}).conversation.thinking


def test_history_reasoning_is_filled_in_thinking_mode_and_dropped_without() -> None:
    messages = [USER, {"role": "assistant", "content": "a"}, USER]
    assert chat(messages=messages).conversation.messages[1].reasoning_content == ""
    off = chat(messages=[USER, {"role": "assistant", "content": "a", "reasoning_content": "r"}, USER],
               thinking={"type": "disabled"})
    assert off.conversation.messages[1].reasoning_content is None


def test_prefix_continuation_sets_the_parsing_stage() -> None:
    answer = chat(messages=[USER, {"role": "assistant", "content": "The", "prefix": True}])
    assert answer.conversation.continues_prefix and answer.parsing.thinking_initial_stage == "content_continuation"
    reasoning = chat(messages=[USER, {"role": "assistant", "content": "", "reasoning_content": "Hm", "prefix": True}])
    assert reasoning.parsing.thinking_initial_stage == "reasoning_continuation"


def test_tools_choice_and_constraints() -> None:
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
        "a": {"type": "string"}}}, "strict": True}} for n in ("f", "g")]
    p = chat(tools=tools, tool_choice={"type": "function", "function": {"name": "g"}}, thinking={"type": "disabled"})
    assert [t.name for t in p.conversation.tools] == ["g"] and p.conversation.tool_choice == "required"
    assert p.conversation.tools[0].parameters["required"] == ["a"]  # strict normalization
    assert p.inference.output_constraint.kind == "tool_call_required" and p.parsing.starts_in_tool_calls
    none = chat(tools=tools, tool_choice="none")
    assert none.conversation.tools == () and none.inference.output_constraint is None


def test_json_formats() -> None:
    p = chat(messages=[{"role": "user", "content": "Reply in JSON"}], response_format={"type": "json_object"})
    assert p.parsing.parse_json_output and p.inference.output_constraint.kind == "json"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    s = chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}})
    assert json.loads(s.inference.output_constraint.schema)["additionalProperties"] is False
    assert s.conversation.response_format.schema == schema  # the prompt shows the client's schema


@pytest.mark.parametrize(("body", "message"), [
    ({"model": "gpt-4", "messages": [USER]},
     "The supported API model names are DeepSeek-V4-Pro, DeepSeek-V4.1-Flash, but you passed gpt-4."),
    ({"model": PRO, "messages": []}, "Empty input messages"),
    ({"model": PRO}, "invalid request body: missing field `messages`"),
    ({"model": 5, "messages": [USER]}, "invalid request body: invalid type: integer `5`, expected a string"),
    ({"model": PRO, "messages": [USER], "temperature": 3},
     "Invalid temperature value, the valid range of temperature is [0, 2]"),
    ({"model": PRO, "messages": [USER], "response_format": {"type": "json_object"}},
     "Prompt must contain the word 'json' in some form to use 'response_format' of type 'json_object'."),
    ({"model": PRO, "messages": [{"role": "tool", "tool_call_id": "x", "content": "r"}]},
     "Messages with role 'tool' must be a response to a preceding message with 'tool_calls'"),
    ({"model": PRO, "messages": [USER], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"}, "Thinking mode does not support this tool_choice"),
])
def test_chat_refusals_are_worded_as_the_reference(body: dict[str, Any], message: str) -> None:
    assert refusal("chat", body) == (400, message)


def test_invalid_json_and_error_bodies_per_api() -> None:
    status, message = refusal("chat", b"{not json")
    assert status == 400 and message.startswith("invalid JSON request: ")
    error = ConversionError("nope")
    assert orjson.loads(api_error("chat", error).body)["error"] == {
        "message": "nope", "type": "invalid_request_error", "param": None, "code": "invalid_request_error"}
    assert orjson.loads(api_error("messages", error).body) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "nope"}}


def test_max_tokens_defaults_and_context_checks() -> None:
    assert resolve_max_tokens(chat(), 10, 1_000_000) == 65_536
    assert resolve_max_tokens(chat(reasoning_effort="max"), 10, 1_000_000) == 131_072
    assert resolve_max_tokens(chat(thinking={"type": "disabled"}), 10, 1_000_000) == 8_192
    assert resolve_max_tokens(chat(), 900, 1000) == 100  # clamped to the context left
    assert resolve_max_tokens(chat(), 1000, 1000) == 1  # never below 1
    with pytest.raises(ConversionError, match=r"you requested 1050 tokens \(950 in the messages, 100 in the"):
        resolve_max_tokens(chat(max_tokens=100), 950, 1000)
    with pytest.raises(ConversionError, match=r"\(1001 in the messages, 0 in the completion\)"):
        resolve_max_tokens(chat(), 1001, 1000)


def test_responses_input_and_settings() -> None:
    body = {"model": FLASH, "instructions": "be brief", "input": [
        {"role": "developer", "content": "d"}, {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c", "name": "f", "namespace": "ns", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "o"}],
        "tools": [{"type": "namespace", "name": "ns", "description": "N",
                   "tools": [{"type": "function", "name": "f"}]}],
        "max_output_tokens": 5, "reasoning": {"effort": "low"}}
    p = convert("responses", json.dumps(body).encode())
    roles = [m.role for m in p.conversation.messages]
    assert roles == ["system", "system", "user", "assistant", "tool"]  # V4.1: developer -> system
    assert p.conversation.messages[3].tool_calls[0].name == "ns::f"
    assert p.extra["namespace_tool_map"] == {"ns::f": ("ns", "f")}
    assert p.echo["instructions"] == "be brief" and p.inference.max_tokens == 5
    assert refusal("responses", {"model": PRO}) == (400, "Either input or instructions must be provided")


def test_messages_blocks_and_limits() -> None:
    body = {"model": PRO, "max_tokens": 10**6, "system": "sys", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                          {"type": "tool_use", "id": "u", "name": "f", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u", "content": "r"}]},
        {"role": "system", "content": "late"}]}
    p = convert("messages", json.dumps(body).encode())
    assert p.inference.max_tokens == 393_216  # lowered to the bound, not refused
    assert [(m.role, m.content) for m in p.conversation.messages] == [
        ("system", "sys"), ("user", "a"), ("user", "b"), ("assistant", ""), ("tool", "r"),
        ("user", "<system-reminder>\nlate\n</system-reminder>")]
    assert p.conversation.messages[3].tool_calls[0].arguments == '{"x": 1}'
    assert refusal("messages", {"model": PRO, "max_tokens": 1, "messages": []}) == (
        400, "messages: at least one message is required")


def test_completions_prompts() -> None:
    p = convert("completions", json.dumps({"model": PRO, "prompt": "Once"}).encode())
    assert p.prompt == "Once" and p.prompt_token_ids is None and p.inference.max_tokens == 16
    assert not p.conversation.thinking and p.inference.temperature == 1.0
    ids = convert("completions", json.dumps({"model": PRO, "prompt": [[1, 2, 3]], "max_tokens": 4}).encode())
    assert ids.prompt_token_ids == [1, 2, 3] and ids.inference.max_tokens == 4
    assert refusal("completions", {"model": PRO, "prompt": ["a", "b"]})[1].endswith(
        "only one prompt per request is supported")
    assert refusal("completions", {"model": PRO, "prompt": "a", "echo": True}) == (400, "echo is not supported")
    assert refusal("completions", {"model": PRO, "prompt": "a", "stop": list("abcde")}) == (
        400, "Stop string array too long: 5")


def test_the_model_table_is_configurable() -> None:
    options = ConvertOptions(models={"SmolLM2-135M-Instruct": "chat_template", PRO: "v4"})
    p = convert("chat", json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [USER]}).encode(), options)
    assert p.encoding == "chat_template" and not p.conversation.thinking
    with pytest.raises(ValueError, match="unknown prompt formats"):
        ConvertOptions(models={"x": "v5"})  # type: ignore[dict-item]


@pytest.mark.parametrize("api", ["chat", "completions", "responses", "messages"])
def test_cache_salt_is_carried_and_checked(api: str) -> None:
    body = {
        "chat": {"model": PRO, "messages": [{"role": "user", "content": "hi"}]},
        "completions": {"model": PRO, "prompt": "hi"},
        "responses": {"model": PRO, "input": "hi"},
        "messages": {"model": PRO, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    }[api]
    assert convert(api, body).cache_salt == ""
    assert convert(api, {**body, "cache_salt": "project-42"}).cache_salt == "project-42"
    for bad in (42, "", "x" * 257):
        with pytest.raises(ConversionError, match="cache_salt") as err:
            convert(api, {**body, "cache_salt": bad})
        assert err.value.status == 400
