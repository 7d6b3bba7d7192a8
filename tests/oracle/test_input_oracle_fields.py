"""Where the input side deliberately differs from deepseek-recipe 0.2.0 about request fields, each shown
against the oracle (services/recipe/convert/fields.py has the rules).

1. `max_completion_tokens` (OpenAI's name for max_tokens, what LangChain, guidellm and `vllm bench serve` send)
   caps the answer, the smaller of the two when both are set; the reference ignores it.
2. `top_k` (Chat, Completions, Anthropic Messages) and vLLM's min_p, repetition_penalty, min_tokens and
   ignore_eos reach the engine; the reference reads none of them.
3. A `developer` message is a system one (a user one for V4, as the reference does in Responses); the
   reference's Chat Completions refuses the role.
4. presence/frequency penalties and logit_bias reach the engine (the reference passes them to its backend);
   a malformed logit_bias, which the reference does not read, is refused by name.
5. What we cannot honour is refused by name instead of passed on: the prompt's logprobs, beam search, image or
   file input (the reference shows V4 the text "[Unsupported Image]"). The neutral values still pass, exactly as the reference converts.
6. logprobs / top_logprobs convert exactly as the reference converts them (and are served); Responses'
   `include: ["message.output_text.logprobs"]` also asks for them (OpenAI's way), which the reference ignores.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.recipe.convert import convert
from services.recipe.errors import ConversionError, FieldRefusal
from tests.oracle.conftest import OPTIONS, compare_request, dr

PRO, FLASH = "DeepSeek-V4-Pro", "DeepSeek-V4.1-Flash"
HI = [{"role": "user", "content": "hi"}]


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": PRO, "messages": HI, "thinking": {"type": "disabled"}, **extra}


def oracle(api: str, body: dict[str, Any]) -> Any:
    requests = {"chat": dr.ChatCompletionRequest, "messages": dr.MessagesRequest, "responses": dr.ResponsesRequest}
    return requests[api](json.dumps(body).encode()).convert(OPTIONS)


@pytest.mark.parametrize("fields, ours", [
    ({"max_completion_tokens": 5}, 5), ({"max_completion_tokens": 5, "max_tokens": 9}, 5),
    ({"max_completion_tokens": 9, "max_tokens": 5}, 5),
])
def test_max_completion_tokens_caps_the_answer_where_the_reference_ignores_it(fields: dict, ours: int) -> None:
    body = chat(**fields)
    assert oracle("chat", body).inference_options.max_tokens == fields.get("max_tokens")
    assert convert("chat", body).inference.max_tokens == ours
    without = {k: v for k, v in body.items() if k != "max_completion_tokens"}
    assert compare_request("chat", without) is None  # everything else as the reference has it


def test_max_completion_tokens_out_of_range_is_refused_by_name() -> None:
    assert oracle("chat", chat(max_completion_tokens=0)).inference_options.max_tokens is None
    with pytest.raises(FieldRefusal) as err:
        convert("chat", chat(max_completion_tokens=0))
    assert err.value.field == "max_completion_tokens" and "[1, 393216]" in err.value.message


def test_sampling_extensions_reach_the_engine_where_the_reference_drops_them() -> None:
    extensions = {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True}
    body = chat(max_tokens=10, **extensions)
    assert compare_request("chat", body) is None  # the reference accepts them and converts the rest the same
    assert not any(hasattr(oracle("chat", body).inference_options, k) for k in extensions)
    inference = convert("chat", body).inference
    assert (inference.top_k, inference.min_p, inference.repetition_penalty, inference.min_tokens,
            inference.ignore_eos) == (40, 0.05, 1.1, 2, True)
    messages = {"model": PRO, "max_tokens": 10, "messages": HI, "top_k": 7}
    assert compare_request("messages", messages) is None
    assert convert("messages", messages).inference.top_k == 7


def test_penalties_and_logit_bias_reach_the_engine() -> None:
    fields = {"presence_penalty": 0.5, "frequency_penalty": -1.0, "logit_bias": {"5": -100, "9": 3}}
    body = chat(**fields)
    assert compare_request("chat", body) is None  # the rest converted as the reference converts it
    io = oracle("chat", body).inference_options
    inference = convert("chat", body).inference
    assert (inference.presence_penalty, inference.frequency_penalty, inference.logit_bias) == (0.5, -1.0,
                                                                                               {5: -100.0, 9: 3.0})
    assert not any(hasattr(io, k) for k in ("presence_penalty", "frequency_penalty", "logit_bias"))
    bad = chat(logit_bias={"x": 1})
    oracle("chat", bad)  # the reference does not read it
    with pytest.raises(FieldRefusal) as err:
        convert("chat", bad)
    assert err.value.field == "logit_bias"
    assert compare_request("chat", bad) is None  # a documented refusal: without it both sides agree


def test_developer_messages_are_system_instructions() -> None:
    messages = [{"role": "developer", "content": "be brief"}, *HI]
    with pytest.raises(ValueError, match="unknown variant `developer`"):
        oracle("chat", chat(messages=messages))
    # As a system message the reference renders it the same: V4.1 keeps it a system turn.
    as_system = [{"role": "system", "content": "be brief"}, *HI]
    ours = convert("chat", chat(model=FLASH, messages=messages)).conversation
    assert ours == convert("chat", chat(model=FLASH, messages=as_system)).conversation
    assert compare_request("chat", chat(model=FLASH, messages=as_system)) is None
    # V4: a user message, as the reference makes a Responses developer message
    v4 = convert("chat", chat(messages=messages)).conversation.messages
    responses = oracle("responses", {"model": PRO, "reasoning": {"effort": "none"}, "input": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    assert [(m.role, m.content) for m in v4] == [(m.role, m.content) for m in responses.conversation.messages]
    # Other roles are still refused in the reference's words (the new role is not in its list).
    bad = chat(messages=[{"role": "boss", "content": "x"}])
    assert compare_request("chat", bad) is None


@pytest.mark.parametrize("api, body, field", [
    ("chat", chat(prompt_logprobs=1), "prompt_logprobs"),
    ("chat", chat(use_beam_search=True), "use_beam_search"),
])
def test_fields_we_cannot_honour_are_refused_by_name(api: str, body: dict, field: str) -> None:
    oracle(api, body)  # the reference accepts the request (and leaves the field to a backend)
    with pytest.raises(FieldRefusal) as err:
        convert(api, body)
    assert err.value.field == field and err.value.message.startswith(f"{field} is not supported")
    assert compare_request(api, body) is None  # the harness: without the field both sides agree


@pytest.mark.parametrize("api, body", [
    ("chat", chat(logprobs=False, presence_penalty=0, frequency_penalty=0.0, n=1)),
    ("chat", chat(response_format={"type": "text"})),
    ("responses", {"model": PRO, "input": "hi", "top_logprobs": 0}),
])
def test_neutral_values_still_pass_as_the_reference_converts(api: str, body: dict) -> None:
    assert compare_request(api, body) is None
    convert(api, body)


@pytest.mark.parametrize("api, body, asked", [
    ("chat", chat(logprobs=True), (True, None)), ("chat", chat(logprobs=True, top_logprobs=3), (True, 3)),
    ("chat", chat(logprobs=True, top_logprobs=21), None), ("chat", chat(top_logprobs=2), None),
    ("responses", {"model": PRO, "input": "hi", "top_logprobs": 2}, (True, 2)),
    ("responses", {"model": PRO, "input": "hi", "top_logprobs": 21}, None),
])
def test_logprobs_convert_as_the_reference_converts(api: str, body: dict, asked: tuple | None) -> None:
    assert compare_request(api, body) is None
    if asked is not None:
        io = convert(api, body).inference
        assert (io.logprobs, io.top_logprobs) == asked


def test_responses_include_asks_for_logprobs_where_the_reference_ignores_it() -> None:
    body = {"model": PRO, "input": "hi", "include": ["message.output_text.logprobs"]}
    assert oracle("responses", body).inference_options.logprobs is False
    assert convert("responses", body).inference.logprobs is True
    assert compare_request("responses", {**body, "include": ["reasoning.encrypted_content"]}) is None


def test_a_refusal_never_hides_the_reference_error() -> None:
    """The reference's checks run first: a request it refuses gets its message, refused fields or not."""
    body = chat(logprobs=True, temperature=3)
    assert compare_request("chat", body) is None
    with pytest.raises(ConversionError, match="Invalid temperature value"):
        convert("chat", body)


@pytest.mark.parametrize("api, body, where", [
    ("chat", chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}]),
     "messages[0].content[1] (image_url)"),
    ("messages", {"model": PRO, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}]}]}, "messages.0.content.0 (image)"),
    ("responses", {"model": PRO, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://x/a.png"}]}]}, "input[0].content[0] (input_image)"),
])
def test_image_input_is_refused_where_the_reference_shows_a_placeholder(api: str, body: dict, where: str) -> None:
    shown = oracle(api, body).conversation.messages
    assert any("[Unsupported Image]" in m.content for m in shown)
    with pytest.raises(FieldRefusal) as err:
        convert(api, body)
    assert err.value.message.startswith(f"{where}: image and file input is not supported")
    assert err.value.field is None
