"""Anthropic Messages: generated requests convert, render and encode exactly as deepseek-recipe does them."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.oracle.conftest import MODELS, Gen, compare_request, mutate, parameters, text


def _text_block(g: Gen) -> dict[str, Any]:
    return {"type": "text", "text": text(g)}


def _media(g: Gen) -> dict[str, Any]:
    if g.chance(0.5):
        source = g.choice([{"type": "url", "url": "https://example.com/a.png"},
                           {"type": "base64", "media_type": "image/png", "data": "AAAA"}])
        return {"type": "image", "source": source}
    return {"type": "document", "source": g.choice([{"type": "text", "media_type": "text/plain", "data": "d"},
                                                     {"type": "url", "url": "https://example.com/a.pdf"}])}


def _user(g: Gen, images: bool) -> dict[str, Any]:
    if g.chance(0.5):
        return {"role": "user", "content": text(g)}
    blocks = [_media(g) if images and g.chance(0.2) else _text_block(g) for _ in range(g.between(1, 3))]
    return {"role": "user", "content": blocks}


def _turn(g: Gen, messages: list[dict[str, Any]], images: bool) -> None:
    blocks: list[dict[str, Any]] = []
    if g.chance(0.4):
        blocks += [{"type": "thinking", "thinking": text(g), "signature": "s"} for _ in range(g.between(1, 2))]
    if g.chance(0.7):
        blocks += [_text_block(g) for _ in range(g.between(1, 2))]
    ids = []
    if g.chance(0.35):
        for _ in range(g.between(1, 3)):
            ids.append(f"tu{g.between(0, 9)}")
            tool_input = g.choice([{}, {"a": 1}, {"b c": "x y"}, {"z": [1, {"k": 1.5e-5}]}, {"é": None}])
            blocks.append({"type": "tool_use", "id": ids[-1], "name": g.choice(["f", "g"]), "input": tool_input})
    blocks = blocks or [_text_block(g)]
    plain = not ids and g.chance(0.2)
    messages.append({"role": "assistant", "content": "".join(b.get("text", "") for b in blocks) if plain else blocks})
    if not ids:
        return
    results = []
    for tool_use_id in g.shuffled(ids):
        if g.chance(0.95):
            result: dict[str, Any] = {"type": "tool_result", "tool_use_id": tool_use_id}
            content = g.choice([text(g), [_text_block(g)], [], None] + ([[_media(g)]] if images else []))
            if content is not None:
                result["content"] = content
            results.append(result)
    messages.append({"role": "user", "content": results + ([_text_block(g)] if g.chance(0.3) else [])})


@st.composite
def messages_requests(draw: Any) -> dict[str, Any]:
    g = Gen(draw)
    model = g.choice(MODELS)
    # V4.1 resolves media with its own checks first; we refuse media for every model (text-only models): a
    # deviation, see documented_refusal
    images = model != "DeepSeek-V4.1-Flash"
    messages: list[dict[str, Any]] = []
    for _ in range(g.between(1, 6)):
        kind = g.choice(["user", "user", "user", "system", "assistant", "assistant"])
        if kind == "user":
            messages.append(_user(g, images))
        elif kind == "system":
            messages.append({"role": "system", "content": text(g) if g.chance(0.5) else [_text_block(g)]})
        else:
            _turn(g, messages, images)
    body: dict[str, Any] = {"model": model, "messages": messages}
    if g.chance(0.9):
        body["max_tokens"] = g.choice([1, 100, 4096, 393216, 393217, 10**6, 0])
    if g.chance(0.3):
        body["system"] = text(g) if g.chance(0.5) else [_text_block(g) for _ in range(g.between(0, 2))]
    if g.chance(0.35):
        body["thinking"] = g.choice([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"},
                                     {"type": "adaptive"}])
    if g.chance(0.25):
        body["output_config"] = {"effort": g.choice(["none", "minimal", "low", "medium", "high", "xhigh", "ultra",
                                                     "max"])}
    if g.chance(0.35):
        tools = []
        for name in g.sample(["f", "g", "h"], g.between(0, 3)):
            tool: dict[str, Any] = {"name": name, "input_schema": parameters(g)}
            if g.chance(0.4):
                tool["description"] = text(g)
            tools.append(tool)
        body["tools"] = tools
        if g.chance(0.5):
            body["tool_choice"] = g.choice([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                            {"type": "tool", "name": g.choice(["f", "g", "zz"])}])
    for key, values in (
        ("temperature", [0, 0.5, 1, 1.5, 2.5]), ("top_p", [0.5, 1, 0]), ("stream", [True, False]),
        ("stop_sequences", [["a"], [], [""], ["x", "y"]]), ("metadata", [{"user_id": "u"}]), ("top_k", [5]),
    ):
        if g.chance(0.1):
            body[key] = g.choice(values)
    if g.chance(0.15):
        mutate(g, body)
    return body


@settings(max_examples=200, deadline=None, derandomize=True)
@given(messages_requests())
def test_generated_messages_requests_match_the_oracle(body: dict[str, Any]) -> None:
    difference = compare_request("messages", body)
    assert difference is None, f"{difference}\nbody: {json.dumps(body, ensure_ascii=False)}"
