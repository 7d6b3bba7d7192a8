"""The V4 and V4.1 formats on conversations built directly (no API conversion in between): every message shape
the model may meet, including ones no API produces (e.g. empty tool-call lists, tool results without ids)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from services.recipe import conversation as cv
from services.recipe.prepared import ToolSpec
from tests.oracle.conftest import Gen, arguments, compare_prompts, dr, parameters, text

IDS = ["a", "b", "c", "d"]


def _message(g: Gen) -> cv.Message:
    role = g.choice(["system", "user", "user", "assistant", "tool", "tool", "latest_reminder"])
    if role == "tool":
        return cv.tool(text(g), g.choice([*IDS, None]))
    if role != "assistant":
        return cv.Message(role, text(g))
    calls = None
    if g.chance(0.5):
        calls = tuple(cv.ToolCall(g.choice(IDS), g.choice(["f", "g h"]), arguments(g)) for _ in range(g.between(0, 3)))
    return cv.assistant(text(g), g.choice([None, "", "r1", "<think>", text(g)]), calls)


@st.composite
def conversations(draw: Any) -> cv.Conversation:
    g = Gen(draw)
    messages = [_message(g) for _ in range(g.between(0, 7))]
    if messages and messages[-1].role == "assistant" and g.chance(0.5):
        last = messages[-1]
        messages[-1] = cv.Message("assistant", last.content, last.reasoning_content, last.tool_calls, prefix=True)
    tools = tuple(
        ToolSpec(g.choice(["f", "g"]), g.choice([None, "d", "<think>", text(g)]),
                 g.choice([None, parameters(g)]), None, g.chance(0.2))
        for _ in range(g.choice([0, 0, 1, 2]))
    )
    fmt = g.choice([cv.TEXT, cv.TEXT, cv.ResponseFormat("json_object"), cv.ResponseFormat("regex", regex="a+"),
                    cv.ResponseFormat("json_schema", {"type": "object", "x": [1.5, 1e-5, 3e20]})])
    return cv.Conversation(tuple(messages), tools, g.choice(["auto", "none", "required"]), g.chance(0.6),
                           g.choice([None, "low", "high", "xhigh", "max"]), fmt)


def to_oracle(conv: cv.Conversation) -> Any:
    messages = []
    for m in conv.messages:
        if m.role == "system":
            messages.append(dr.SystemMessage(m.content))
        elif m.role == "user":
            messages.append(dr.UserMessage(m.content))
        elif m.role == "tool":
            messages.append(dr.ToolMessage(m.content, m.tool_call_id))
        elif m.role == "latest_reminder":
            messages.append(dr.LatestReminderMessage(m.content))
        else:
            calls = None if m.tool_calls is None else [dr.ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls]
            messages.append(dr.AssistantMessage(m.content, m.reasoning_content, calls, m.prefix))
    fmt = conv.response_format
    formats = {"json_object": {"response_format": "json_object"}, "json_schema": {"response_schema": fmt.schema},
               "regex": {"response_regex": fmt.regex}}.get(fmt.kind, {})
    tools = [dr.ToolDefinition(t.name, t.description, t.parameters, t.strict, t.defer_loading) for t in conv.tools]
    return dr.Conversation(messages, thinking_mode=conv.thinking, tools=tools, tool_choice=conv.tool_choice,
                           reasoning_effort=conv.reasoning_effort, **formats)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(conversations())
def test_generated_conversations_render_and_encode_as_the_oracle(conv: cv.Conversation) -> None:
    difference = compare_prompts(to_oracle(conv), conv)
    assert difference is None, f"{difference}\nconversation: {conv}"


def test_tool_results_are_put_in_call_order_as_the_oracle_does() -> None:
    calls = tuple(cv.ToolCall(i, "f", "{}") for i in "abc")
    for order in ("cba", "bca", "acb"):
        for between in ([], [cv.user("q")]):
            results = [cv.tool(f"r{i}", i) for i in order]
            conv = cv.Conversation((cv.user("go"), cv.assistant("", None, calls), *between, *results), thinking=False)
            assert compare_prompts(to_oracle(conv), conv) is None
