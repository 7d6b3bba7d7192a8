"""max_tokens defaults and context checks (`resolve_max_tokens`) as deepseek-recipe computes them, and the input
side's handling of a tool parameter named with a space (the reference's 0.2.0 parser breaks on those)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from services.recipe.convert import convert
from services.recipe.convert.limits import resolve_max_tokens
from services.recipe.errors import ConversionError
from services.recipe.formats import render
from tests.oracle.conftest import OPTIONS, compare_request, dr

SETTINGS = [
    {}, {"thinking": {"type": "disabled"}}, {"reasoning_effort": "max"}, {"reasoning_effort": "ultra"},
    {"reasoning_effort": "low"}, {"thinking": {"type": "disabled"}, "reasoning_effort": "max"},
]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.sampled_from(SETTINGS), st.one_of(st.none(), st.integers(1, 393216)),
       st.integers(0, 300_000), st.integers(0, 400_000))
def test_max_tokens_resolve_as_the_oracle(extra: dict[str, Any], max_tokens: int | None, prompt: int,
                                          context: int) -> None:
    body = {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "hi"}], **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    raw = json.dumps(body).encode()
    oracle = dr.ChatCompletionRequest(raw).convert(OPTIONS)
    ours = convert("chat", raw)
    try:
        expected: Any = oracle.resolve_max_tokens(prompt, context)
    except dr.ConversionError as exc:
        expected = (exc.status_code, json.loads(exc.body)["error"]["message"])
    try:
        got: Any = resolve_max_tokens(ours, prompt, context)
    except ConversionError as exc:
        got = (exc.status, exc.message)
    assert got == expected


def test_parameter_names_with_spaces_survive_the_input_side() -> None:
    """deepseek-recipe 0.2.0 turns a streamed `<｜DSML｜parameter name="a b" ...>` into broken JSON ({"a: ...});
    on the way in, such names must reach the prompt intact: in the tool schema, in strict normalization, and in
    past calls (where the arguments are re-read from JSON)."""
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a b": {"type": "string"}, "c": {"type": "integer"}}}}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a b": "v", "c": 1}'}}
    body = {"model": "DeepSeek-V4-Pro", "thinking": {"type": "disabled"}, "tools": [tool], "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]}
    assert compare_request("chat", body) is None
    prepared = convert("chat", json.dumps(body).encode())
    assert prepared.conversation.tools[0].parameters["required"] == ["a b", "c"]
    prompt, _ = render(prepared)
    assert '"properties": {"a b": {"type": "string"}' in prompt
    assert 'parameter name="a b" string="true">v<' in prompt
    assert json.loads(prepared.conversation.messages[1].tool_calls[0].arguments) == {"a b": "v", "c": 1}
