"""V4.1 image requests in the three APIs against deepseek-recipe, end to end on the codec side: the conversion
(messages, image sources with their detail and request location, errors), the prompt and its control tokens
(placeholders included), the resolved images' sizes and token counts (or the same 400), the prompt token ids
(with a V4.1-capable test tokenizer: the packaged V4 one has no <｜System｜>) and the expanded prompt's length
(the reference's `image_token_adjustment`)."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.recipe.convert import convert
from services.recipe.errors import ConversionError
from services.recipe.formats.deepseek import FORMATS
from services.recipe.formats.deepseek_tokenizer import deepseek_v4_encoder, tokenizer_path
from services.recipe.images.limits import ImageQuota
from services.recipe.images.prompt import expand
from services.recipe.images.resolve import ImageError, resolve
from tests.images import gif, jpeg, png
from tests.oracle.conftest import OPTIONS, Gen, compare_request, dr, text
from tests.oracle.test_image_oracle import NoFetch, oracle_resolve

MODEL = "DeepSeek-V4.1-Flash"
DETAILS = [None, "low", "high", "original", "auto"]


@pytest.fixture(scope="module")
def v41_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packaged tokenizer plus the one V4.1 control token it lacks."""
    data = orjson.loads(tokenizer_path().read_bytes())
    top = max(t["id"] for t in data["added_tokens"])
    data["added_tokens"].append({"id": top + 1, "content": "<｜System｜>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_bytes(orjson.dumps(data))
    return path


def image_url(g: Gen) -> str:
    kind = g.choice(["png", "png", "jpeg", "gif", "broken", "http", "other"])
    w, h = g.between(1, 60), g.between(1, 60)
    if kind in ("png", "jpeg", "gif"):
        data = {"png": lambda: png(np.full((h, w, 3), 90, np.uint8)), "jpeg": lambda: jpeg(w, h),
                "gif": lambda: gif(w, h)}[kind]()
        mime = g.choice([kind, "png", "jpeg", "webp"])
        return f"data:image/{mime};base64," + base64.b64encode(data).decode()
    if kind == "broken":
        return g.choice(["data:image/png;base64,!!", "data:image/png;base64,AAAA", "data:text/plain;base64,AA",
                         "data:image/png,AA", "data:x", "data:image/png;base64,"])
    if kind == "http":
        # IP literals only: the reference resolves a host name before its destination filter refuses it
        return g.choice(["http://127.0.0.1:1/a.png", "https://127.0.0.1:1/" + "a" * 8200])
    return g.choice(["ftp://x/y", "", "image.png"])


def chat_part(g: Gen) -> dict[str, Any]:
    if g.chance(0.4):
        return {"type": "text", "text": text(g)}
    url: dict[str, Any] = {"url": image_url(g)}
    if (detail := g.choice(DETAILS)) is not None:
        url["detail"] = detail
    return {"type": "image_url", "image_url": url}


def chat_body(g: Gen) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if g.chance(0.3):
        messages.append({"role": "system", "content": [chat_part(g) for _ in range(g.between(1, 2))]})
    messages.append({"role": "user", "content": [chat_part(g) for _ in range(g.between(1, 3))]})
    if g.chance(0.4):
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
        result = [chat_part(g) for _ in range(g.between(1, 2))]
        messages.append({"role": "tool", "tool_call_id": "c1", "content": result})
        if g.chance(0.2):
            messages.append({"role": "assistant", "content": [chat_part(g)]})
    return {"model": MODEL, "messages": messages}


def responses_part(g: Gen) -> dict[str, Any]:
    if g.chance(0.4):
        return {"type": "input_text", "text": text(g)}
    part: dict[str, Any] = {"type": "input_image"}
    if g.chance(0.9):
        part["image_url"] = image_url(g)
    if g.chance(0.1):
        part["file_id"] = "file-1"
    if (detail := g.choice(DETAILS)) is not None:
        part["detail"] = detail
    return part


def responses_body(g: Gen) -> dict[str, Any]:
    items: list[dict[str, Any]] = [{"role": g.choice(["user", "user", "system", "developer"]),
                                    "content": [responses_part(g) for _ in range(g.between(1, 3))]}]
    if g.chance(0.4):
        items.append({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"})
        items.append({"type": "function_call_output", "call_id": "c",
                      "output": [responses_part(g) for _ in range(g.between(1, 2))]})
    if g.chance(0.1):
        items.append({"role": "assistant", "content": [responses_part(g)]})
    items.append({"role": "user", "content": text(g) or "q"})
    return {"model": MODEL, "input": items}


def messages_block(g: Gen) -> dict[str, Any]:
    if g.chance(0.4):
        return {"type": "text", "text": text(g) or "t"}
    if g.chance(0.7):
        url = image_url(g)
        data = url.split(",", 1)[1] if url.startswith("data:") and "," in url else g.choice(["AAAA", "AA", "!"])
        media = g.choice(["image/png", "image/jpeg", "image/jpg", "image/gif", "image/webp"])
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": image_url(g)}}


def messages_body(g: Gen) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": [messages_block(g) for _ in range(g.between(1, 3))]}]
    if g.chance(0.4):
        messages.append({"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [messages_block(g) for _ in range(g.between(1, 2))]},
            {"type": "text", "text": "after"}]})
        if g.chance(0.15):
            messages.append({"role": "assistant", "content": [messages_block(g)]})
            messages.append({"role": "user", "content": "u"})
    return {"model": MODEL, "max_tokens": 16, "messages": messages}


def _each_error(sources: list[Any]) -> set[str]:
    """Our error for each source on its own, located as it is in the request (its index at its location)."""
    errors = set()
    for n, source in enumerate(sources):
        try:
            asyncio.run(resolve([source], ImageQuota(), NoFetch()))
        except ImageError as exc:
            k = sum(s.path == source.path for s in sources[:n])
            errors.add(exc.message.replace(f"{source.path}.image[0]:", f"{source.path}.image[{k}]:", 1))
    return errors


BODIES = {"chat": chat_body, "responses": responses_body, "messages": messages_body}
REQUESTS = {"chat": dr.ChatCompletionRequest, "responses": dr.ResponsesRequest, "messages": dr.MessagesRequest}


def check_request(api: str, body: dict[str, Any], tokenizer: Path) -> None:
    difference = compare_request(api, body)
    assert difference is None, difference
    raw = json.dumps(body).encode()
    try:
        oracle = REQUESTS[api](raw).convert(OPTIONS)
    except dr.ConversionError:
        return  # an error both sides gave (compared above)
    ours = convert(api, raw)
    rendered = FORMATS["v41"].render(ours.conversation)
    expected = dr.DeepseekV41Encoding().render_conversation(oracle.conversation)
    try:
        data = dr.ImageResolver(dr.ReqwestImageFetcher().with_destination_filter(lambda h, a: False),
                                dr.OpenCvImagePreprocessor()).resolve(expected.image_sources, dr.ImageQuota())
    except dr.ImageError as exc:
        with pytest.raises(ImageError) as caught:
            asyncio.run(resolve(list(rendered.images), ImageQuota(), NoFetch()))
        if caught.value.message != str(exc):
            # Several bad images: the reference resolves 8 at a time and names the first to fail, which need
            # not be the first in the prompt. Its error must still be one of ours, image by image.
            assert str(exc) in _each_error(list(rendered.images)), (caught.value.message, str(exc))
        return
    images = asyncio.run(resolve(list(rendered.images), ImageQuota(), NoFetch()))
    assert [(i.width, i.height) for i in images] == [(i.width, i.height) for i in data.images]
    encoder = deepseek_v4_encoder(tokenizer)
    ids = encoder.encode(rendered)
    assert ids == dr.DeepseekV41Encoding().with_tokenizer(dr.Tokenizer.from_file(str(tokenizer))).encode(
        oracle.conversation)
    expanded, records = expand(ids, images, encoder.control_ids["<｜image｜>"])
    assert len(expanded) == len(ids) + data.image_token_adjustment()
    assert [r.length for r in records] == [dr.MultiModalData([i]).image_token_adjustment() + 1 for i in data.images]


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                   HealthCheck.function_scoped_fixture])
@given(st.sampled_from(sorted(BODIES)), st.data())
def test_image_requests_are_the_oracles(v41_tokenizer: Path, api: str, data: st.DataObject) -> None:
    check_request(api, BODIES[api](Gen(data.draw)), v41_tokenizer)


def test_v4_keeps_its_text_and_the_refusal() -> None:
    """V4 has no image input: the reference shows it "[Unsupported Image]", we refuse the request (a 400)."""
    body = {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    assert compare_request("chat", body) is None
    with pytest.raises(ConversionError) as caught:
        convert("chat", json.dumps(body).encode())
    assert caught.value.status == 400 and "image and file input is not supported" in caught.value.message
