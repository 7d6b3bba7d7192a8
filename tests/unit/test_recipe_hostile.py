"""Prompts and schemas that pass the body's shape but would fail later (in the tokenizer, in a recursive walk, in
the engine after queueing): the recipe refuses each with a 400 in the API's format, before anything is queued.
The real SmolLM2 tokenizer and chat template; no bus (a refusal never reaches it)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from services.recipe.convert import schema, strict
from services.recipe.errors import SchemaError, StrictError
from services.recipe.model import ServedModel
from services.recipe.service import RecipeService
from shared.json_depth import MAX_JSON_DEPTH
from shared.schemas.gateway import CountTokensRequest, PrepareRequest

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return ServedModel.load(MODEL)


@pytest.fixture
def recipe(model: ServedModel) -> RecipeService:
    """A recipe with its model loaded and no bus: `prepare` refusals return before anything is submitted."""
    service = RecipeService([MODEL])
    service._models = {model.name: model}
    service._options = service._options.__class__(models={model.name: model.encoding})
    return service


DEEP = "DEEP"  # a schema too deep for orjson.dumps to write: `encode` splices its JSON text in


def encode(body: dict[str, Any], levels: int = 500) -> bytes:
    deep = b'{"type": "array", "items": ' * levels + b'{"type": "string"}' + b"}" * levels
    return orjson.dumps(body).replace(b'"DEEP"', deep)


async def refusal(recipe: RecipeService, api: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    reply = await recipe.prepare(PrepareRequest("r1", api, encode(body), "tenant"))
    assert not reply.ok
    return reply.status, orjson.loads(reply.error_body)


def deep_schema(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        node = {"type": "array", "items": node}
    return node


async def test_an_empty_prompt_is_refused_as_vllm_does(recipe: RecipeService) -> None:
    status, body = await refusal(recipe, "completions", {"model": MODEL, "prompt": ""})
    assert status == 400
    assert body["error"] == {"message": "The decoder prompt cannot be empty", "type": "invalid_request_error",
                             "param": None, "code": "invalid_request_error"}


async def test_token_ids_past_the_vocabulary_are_refused(recipe: RecipeService, model: ServedModel) -> None:
    vocab = model.vocab_size
    assert vocab == 49_152
    for bad in (vocab, 2**31 - 1, 2**31, 2**32, 2**63 - 1):  # 2^32 and past: the tokenizer's u32 overflowed
        status, body = await refusal(recipe, "completions", {"model": MODEL, "prompt": [1, bad, 2]})
        assert status == 400, bad
        assert body["error"]["message"] == f"Token id {bad} is out of vocabulary (the model has {vocab} tokens)"
    # ids the model knows pass these checks (and fail only at submit, here with no bus)
    prepared, _, ids, _ = recipe._prepare("completions", {"model": MODEL, "prompt": [1, vocab - 1]})
    assert ids == [1, vocab - 1] and prepared.prompt_token_ids == [1, vocab - 1]


async def test_deeply_nested_tools_and_formats_are_400s(recipe: RecipeService) -> None:
    deep = DEEP  # 500 levels (1,000 of JSON, under orjson's limit): past Python's recursion limit when walked
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                        "properties": {"a": deep}}}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    strict_format = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": deep}}
    for body in ({**chat, "tools": [tool]}, {**chat, "response_format": strict_format}):
        status, error = await refusal(recipe, "chat", body)
        assert status == 400
        limit = f"the request nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"
        assert error["error"]["message"] == limit
    messages = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": deep}}}]}
    status, error = await refusal(recipe, "messages", messages)
    assert status == 400 and error["type"] == "error" and "levels deep" in error["error"]["message"]


async def test_count_tokens_answers_a_deep_schema_with_a_400(recipe: RecipeService) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": DEEP}}}]}
    reply = await recipe.count_tokens(CountTokensRequest("messages", encode(body)))
    assert reply.status == 400 and "levels deep" in orjson.loads(reply.body)["error"]["message"]
    del body["tools"]  # (SmolLM2's template takes no tools)
    reply = await recipe.count_tokens(CountTokensRequest("messages", orjson.dumps(body)))
    assert reply.status == 200 and orjson.loads(reply.body)["input_tokens"] > 10


def test_each_schema_walk_has_its_own_depth_limit() -> None:
    """Called directly (not behind the body's check), the walks still refuse a schema they cannot walk."""
    deep = deep_schema(2_000)
    with pytest.raises(SchemaError, match="levels deep"):
        schema.check({"type": "object", "properties": {"a": deep}})
    with pytest.raises(StrictError, match="levels deep"):
        strict.normalize({"type": "object", "properties": {"a": deep}}, empty_top=True)
    schema.check(deep_schema(20))  # a deep but reasonable schema is walked as before
    assert strict.normalize({"type": "object", "properties": {"a": deep_schema(20)}}, empty_top=True)[1]
