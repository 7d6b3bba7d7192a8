"""OpenAI Responses: generated requests convert, render and encode exactly as deepseek-recipe does them."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.oracle.conftest import MODELS, Gen, arguments, compare_request, mutate, parameters, schema, text


def _content(g: Gen, kinds: list[str], images: bool) -> Any:
    if g.chance(0.6):
        return text(g)
    kinds = kinds if images else [k for k in kinds if k.endswith("text")]
    parts = []
    for _ in range(g.between(0, 3)):
        kind = g.choice(kinds)
        if kind.endswith("text"):
            parts.append({"type": kind, "text": text(g)})
        elif kind == "input_image":
            parts.append({"type": "input_image", "image_url": "https://example.com/a.png"})
        else:
            parts.append({"type": "input_file", "file_id": "file-1"})
    return parts


def _calls(g: Gen, items: list[dict[str, Any]], images: bool) -> None:
    ids = [f"c{g.between(0, 9)}" for _ in range(g.between(1, 3))]
    for call_id in ids:
        items.append({"type": "function_call", "call_id": call_id, "name": g.choice(["f", "g", "ns__f"]),
                      "arguments": arguments(g)})
    for call_id in (g.shuffled(ids) if g.chance(0.5) else ids):
        if g.chance(0.95):
            output = _content(g, ["input_text", "input_image", "input_file"], images)
            items.append({"type": "function_call_output", "call_id": call_id, "output": output})


def _items(g: Gen, images: bool) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for _ in range(g.between(0, 7)):
        kind = g.choice(["user", "user", "user", "assistant", "reasoning", "calls", "calls", "skipped", "patch"])
        if kind == "user":
            role = g.choice(["user", "user", "system", "developer"])
            message = {"role": role, "content": _content(g, ["input_text", "output_text", "input_image",
                                                                "input_file"], images)}
            items.append({"type": "message", **message} if g.chance(0.3) else message)
        elif kind == "assistant":
            items.append({"type": "message", "role": "assistant", "content": _content(g, ["output_text"], images)})
        elif kind == "reasoning":
            content = [{"type": "reasoning_text", "text": text(g)} for _ in range(g.between(0, 2))]
            items.append({"type": "reasoning", "summary": [], **({"content": content} if g.chance(0.8) else {})})
        elif kind == "calls":
            _calls(g, items, images)
        elif kind == "skipped":
            items.append({"type": g.choice(["web_search_call", "item_reference", "bogus"]), "id": "x"})
        else:  # the built-in apply_patch custom tool, always answered
            call_id = f"p{g.between(0, 9)}"
            items.append({"type": "custom_tool_call", "call_id": call_id, "name": "apply_patch", "input": text(g)})
            items.append({"type": "custom_tool_call_output", "call_id": call_id, "output": text(g)})
    return items


def _tools(g: Gen) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    for name in g.sample(["f", "g", "h"], g.between(0, 3)):
        tool: dict[str, Any] = {"type": "function", "name": name}
        if g.chance(0.5):
            tool["description"] = text(g)
        if g.chance(0.6):
            tool["parameters"] = parameters(g)
        if g.chance(0.2):
            tool["strict"] = g.chance(0.5)
        tools.append(tool)
    if g.chance(0.2):
        tools.append({"type": "namespace", "name": "ns", "description": text(g),
                      "tools": [{"type": "function", "name": "f", "description": text(g)}]})
    if g.chance(0.15):
        tools.append({"type": "custom", "name": "apply_patch"})
    if g.chance(0.1):
        tools.append({"type": "web_search"})
    return tools


@st.composite
def responses_requests(draw: Any) -> dict[str, Any]:
    g = Gen(draw)
    model = g.choice(MODELS)
    # V4.1 resolves media with its own checks first; we refuse media for every model (text-only models): a
    # deviation, see documented_refusal
    images = model != "DeepSeek-V4.1-Flash"
    body: dict[str, Any] = {"model": model}
    if g.chance(0.85):
        items = _items(g, images)
        body["input"] = items if items or g.chance(0.3) else text(g)
    if g.chance(0.3):
        body["instructions"] = text(g)
    if g.chance(0.4):
        body["reasoning"] = {"effort": g.choice(["none", "minimal", "low", "medium", "high", "xhigh", "ultra",
                                                 "max", None])} if g.chance(0.9) else {}
    if g.chance(0.35):
        body["tools"] = _tools(g)
        if g.chance(0.5):
            body["tool_choice"] = g.choice(["none", "auto", "required", {"type": "custom", "name": "apply_patch"},
                                            {"type": "function", "name": g.choice(["f", "g", "zz", "ns__f"])}])
    if g.chance(0.2):
        body["text"] = {"format": g.choice([
            {"type": "json_object"}, {"type": "text"},
            {"type": "json_schema", "name": "n", "schema": schema(g), "strict": g.chance(0.3)},
        ])}
    for key, values in (
        ("max_output_tokens", [1, 100, 393216, 393217, 0]), ("temperature", [0, 0.5, 1.3, 2, 2.5, -1]),
        ("top_p", [0.1, 0.5, 0.96, 1, 0, 1.5]), ("top_logprobs", [0, 5, 21]), ("stream", [True, False]),
        ("user", ["u"]), ("parallel_tool_calls", [False]),
    ):
        if g.chance(0.1):
            body[key] = g.choice(values)
    if g.chance(0.15):
        mutate(g, body)
    return body


@settings(max_examples=200, deadline=None, derandomize=True)
@given(responses_requests())
def test_generated_responses_requests_match_the_oracle(body: dict[str, Any]) -> None:
    difference = compare_request("responses", body)
    assert difference is None, f"{difference}\nbody: {json.dumps(body, ensure_ascii=False)}"


def test_a_turn_of_calls_gathers_until_every_call_is_answered() -> None:
    call = lambda i: {"type": "function_call", "call_id": i, "name": "f", "arguments": "{}"}  # noqa: E731
    out = lambda i: {"type": "function_call_output", "call_id": i, "output": i}  # noqa: E731
    items = [{"role": "user", "content": "q"}, call("a"), call("b"), out("b"), call("c"), out("a"), out("c")]
    assert compare_request("responses", {"model": "DeepSeek-V4-Pro", "input": items}) is None
