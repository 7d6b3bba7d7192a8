"""vLLM's /tokenize and /detokenize on the recipe side, with the real SmolLM2 tokenizer and chat template."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from services.recipe import tokenize
from services.recipe.convert import ConvertOptions
from services.recipe.errors import ConversionError
from services.recipe.model import ServedModel
from services.recipe.queries import _answer

MODEL = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def served() -> tuple[dict[str, ServedModel], ConvertOptions]:
    model = ServedModel.load(MODEL)
    return {model.name: model}, ConvertOptions(models={model.name: model.encoding})


def tok(served: tuple[dict[str, ServedModel], ConvertOptions], body: dict[str, Any]) -> dict[str, Any]:
    return tokenize.tokenize(body, *served)


def test_prompt_round_trips_through_detokenize(served: Any) -> None:
    out = tok(served, {"model": MODEL, "prompt": "The capital of France is", "return_token_strs": True})
    assert out["count"] == len(out["tokens"]) > 3 and out["max_model_len"] == 8192
    assert out["token_strs"][1] == "Ġcapital"  # the vocabulary's own pieces, as vLLM's convert_ids_to_tokens
    assert tokenize.detokenize({"model": MODEL, "tokens": out["tokens"]}, served[0]) == {
        "prompt": "The capital of France is"}
    assert "token_strs" not in tok(served, {"prompt": "x"})  # the model is optional: the first served one


def test_chat_renders_the_template_as_a_chat_request_does(served: Any) -> None:
    models, _ = served
    text = models[MODEL].template.render(HI, add_generation_prompt=True)
    out = tok(served, {"model": MODEL, "messages": HI})
    assert out["tokens"] == models[MODEL].tokenizer.encode(text)
    assert tokenize.detokenize({"tokens": out["tokens"]}, models)["prompt"] == text  # special tokens spelled out
    assert text.endswith("<|im_start|>assistant\n")
    closed = tok(served, {"messages": HI, "add_generation_prompt": False})
    assert closed["tokens"] == out["tokens"][: closed["count"]] and closed["count"] < out["count"]


def test_continue_final_message(served: Any) -> None:
    messages = [*HI, {"role": "assistant", "content": "Hello, I am"}]
    out = tok(served, {"messages": messages, "continue_final_message": True, "add_generation_prompt": False})
    assert tokenize.detokenize({"tokens": out["tokens"]}, served[0])["prompt"].endswith(
        "<|im_start|>assistant\nHello, I am")
    with pytest.raises(ConversionError, match="Cannot set both"):
        tok(served, {"messages": messages, "continue_final_message": True})
    with pytest.raises(ConversionError, match="final assistant message"):
        tok(served, {"messages": HI, "continue_final_message": True, "add_generation_prompt": False})


@pytest.mark.parametrize(("body", "status", "match"), [
    ({"model": "nope", "prompt": "x"}, 404, "The model `nope` does not exist."),
    ({"model": 3, "prompt": "x"}, 400, "'model' must be a string"),
    ({"model": MODEL}, 400, "either 'prompt' or 'messages'"),
    ({"prompt": ["x"]}, 400, "'prompt' must be a string"),
    ({"prompt": "x", "add_special_tokens": "yes"}, 400, "'add_special_tokens' must be a boolean"),
    ({"messages": HI, "chat_template": "{{ messages }}"}, 400, "'chat_template' is not supported"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "wizard"),  # the chat conversion's own refusal
])
def test_tokenize_refusals(served: Any, body: dict[str, Any], status: int, match: str) -> None:
    with pytest.raises(ConversionError, match=match) as info:
        tok(served, body)
    assert info.value.status == status


@pytest.mark.parametrize(("tokens", "match"), [
    ([1, 49152], "Token id 49152 is out of vocabulary"),
    ([-1], "Token id -1 is out of vocabulary"),
    ([1, "2"], r"'tokens\[1\]' must be an integer"),
    ([True], r"'tokens\[0\]' must be an integer"),
    ("1 2", "'tokens' must be a list"),
])
def test_detokenize_refuses_bad_ids(served: Any, tokens: Any, match: str) -> None:
    with pytest.raises(ConversionError, match=match) as info:
        tokenize.detokenize({"tokens": tokens}, served[0])
    assert info.value.status == 400


def test_replies_carry_openai_error_bodies(served: Any) -> None:
    work = lambda body: tok(served, body)  # noqa: E731
    ok = _answer(work, orjson.dumps({"prompt": "Hi"}))
    assert ok.status == 200 and orjson.loads(ok.body)["count"] >= 1
    missing = _answer(work, orjson.dumps({"model": "nope", "prompt": "Hi"}))
    error = orjson.loads(missing.body)["error"]
    assert missing.status == 404 and error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    assert _answer(work, b"[1]").status == 400
    assert "invalid JSON" in orjson.loads(_answer(work, b"{").body)["error"]["message"]
