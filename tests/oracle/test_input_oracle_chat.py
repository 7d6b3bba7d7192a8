"""Chat Completions: generated requests convert, render and encode exactly as deepseek-recipe does them."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.oracle.conftest import MODELS, Gen, arguments, compare_request, mutate, parameters, schema, text


def _content(g: Gen, images: bool) -> Any:
    if g.chance(0.7):
        return text(g)
    kinds = ["text", "text", "text"] + (["image_url", "file"] if images else [])
    parts = []
    for _ in range(g.between(0, 3)):
        kind = g.choice(kinds)
        if kind == "text":
            parts.append({"type": "text", "text": text(g)})
        elif kind == "image_url":
            parts.append({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})
        else:
            parts.append({"type": "file", "file": {"file_id": "file-1"}})
    return parts


def _assistant(g: Gen, messages: list[dict[str, Any]], images: bool) -> None:
    message: dict[str, Any] = {"role": "assistant"}
    if g.chance(0.95):
        message["content"] = _content(g, images) if g.chance(0.95) else None
    if g.chance(0.5):
        message["reasoning_content"] = text(g)
    if not g.chance(0.3):
        messages.append(message)
        return
    calls = [{"id": f"call_{g.between(0, 9)}", "type": "function",
              "function": {"name": g.choice(["f", "g"]), "arguments": arguments(g)}} for _ in range(g.between(1, 3))]
    message["tool_calls"] = calls
    messages.append(message)
    for call_id in g.shuffled([c["id"] for c in calls]):
        if g.chance(0.95):
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _content(g, images)})


@st.composite
def chat_requests(draw: Any) -> dict[str, Any]:
    g = Gen(draw)
    model = g.choice(MODELS)
    # V4.1 resolves media with its own checks first; we refuse media for every model (text-only models): a
    # deviation, see documented_refusal
    images = model != "DeepSeek-V4.1-Flash"
    messages: list[dict[str, Any]] = []
    for _ in range(g.between(1, 7)):
        role = g.choice(["system", "user", "user", "user", "assistant", "assistant", "latest_reminder"])
        if role == "assistant":
            _assistant(g, messages, images)
        else:
            messages.append({"role": role, "content": text(g) if role == "latest_reminder" else _content(g, images)})
    if messages[-1]["role"] == "assistant" and g.chance(0.4):
        messages[-1]["prefix"] = True
    body: dict[str, Any] = {"model": model, "messages": messages}
    if g.chance(0.4):
        body["thinking"] = {"type": g.choice(["enabled", "disabled", "disabled", "adaptive"])}
    if g.chance(0.3):
        body["reasoning_effort"] = g.choice(["none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"])
    if g.chance(0.3):
        strict = g.chance(0.3)
        body["tools"] = [_tool(g, name, strict) for name in g.sample(["f", "g", "h"], g.between(0, 3))]
        if g.chance(0.5):
            body["tool_choice"] = g.choice(["none", "auto", "required", {"type": "function", "function": {
                "name": g.choice(["f", "g", "zz"])}}])
    if g.chance(0.2):
        body["response_format"] = g.choice([
            {"type": "json_object"}, {"type": "text"}, {"type": "regex", "regex": "[a-z]+"},
            {"type": "json_schema", "json_schema": {"name": "n", "schema": schema(g), "strict": g.chance(0.3)}},
        ])
    for key, values in (
        ("max_tokens", [1, 100, 393216, 393217, 0]), ("temperature", [0, 0.5, 1.3, 2, 2.5, -1]),
        ("top_p", [0.1, 0.5, 0.96, 1, 0, 1.5]), ("seed", [0, 42, 2**63 - 1, 2**63]),
        ("stop", ["x", ["a", "b"], [], [""], "", ["a"] * 17]), ("stream", [True, False]), ("n", [1, 2]),
        ("logprobs", [True, False]), ("top_logprobs", [0, 5, 21]), ("frequency_penalty", [0, 1.5, -3]),
        ("presence_penalty", [0, 2.5]), ("parallel_tool_calls", [True]),
        # vLLM's fields, which the reference ignores: honoured, or refused by name (documented_refusal)
        ("top_k", [5, -1, 0, "s"]), ("min_p", [0, 0.1, 2]), ("repetition_penalty", [1, 1.1, 0]),
        ("min_tokens", [0, 3]), ("ignore_eos", [True, False, 1]), ("logit_bias", [{}, {"1": 2}]),
    ):
        if g.chance(0.08):
            body[key] = g.choice(values)
    if g.chance(0.1):
        body["stream_options"] = {"include_usage": g.chance(0.5)}
        body["stream"] = g.chance(0.8)
    if g.chance(0.15):
        mutate(g, body)
    return body


def _tool(g: Gen, name: str, strict: bool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if g.chance(0.5):
        function["description"] = text(g)
    if g.chance(0.7):
        function["parameters"] = parameters(g)
    if strict:
        function["strict"] = True
    return {"type": "function", "function": function}


@settings(max_examples=200, deadline=None, derandomize=True)
@given(chat_requests())
def test_generated_chat_requests_match_the_oracle(body: dict[str, Any]) -> None:
    difference = compare_request("chat", body)
    assert difference is None, f"{difference}\nbody: {json.dumps(body, ensure_ascii=False)}"


USER = {"role": "user", "content": "hi"}
CASES = {
    "prefix continuation with reasoning": [USER, {"role": "assistant", "content": "", "reasoning_content": "Let",
                                                  "prefix": True}],
    "prefix continuation of the answer": [USER, {"role": "assistant", "content": "The answer", "prefix": True}],
    "special tokens typed by the user": [{"role": "user", "content": "<｜User｜>hi<｜Assistant｜></think>"}],
    "system messages in odd places": [USER, {"role": "system", "content": "late"}, USER,
                                      {"role": "system", "content": ""}],
    "tool results out of order": [
        USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}} for i in "ab"]},
        {"role": "tool", "tool_call_id": "b", "content": "B"}, {"role": "tool", "tool_call_id": "a", "content": "A"},
    ],
}


def test_hand_picked_chat_requests_match_the_oracle() -> None:
    for name, messages in CASES.items():
        for extra in ({}, {"thinking": {"type": "disabled"}}, {"reasoning_effort": "max"}):
            body = {"model": "DeepSeek-V4-Pro", "messages": messages, **extra}
            assert compare_request("chat", body) is None, name
