"""Request fields beyond the reference's (services/recipe/convert/fields.py): what is honoured, what reaches the
engine's SamplingParams, what is refused by name; the developer role; image input; ignore_eos on the output
side. tests/oracle/test_input_oracle_fields.py shows the same rules against deepseek-recipe."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson
import pytest

from services.recipe.convert import ConvertOptions, convert
from services.recipe.convert.fields import REFUSED, check_logit_bias, check_min_tokens
from services.recipe.emit import OutputProcessor, Ready, Tokens
from services.recipe.errors import ConversionError, FieldRefusal, api_error
from services.recipe.parse import TokenTable
from services.recipe.service import sampling_params
from shared.schemas.generate import SamplingParams

SMOL = "SmolLM2-135M-Instruct"
OPTIONS = ConvertOptions(models={SMOL: "chat_template", "DeepSeek-V4-Pro": "v4", "DeepSeek-V4.1-Flash": "v41"})
USER = {"role": "user", "content": "hi"}


def chat(**body: Any) -> Any:
    return convert("chat", {"model": SMOL, "messages": [USER], **body}, OPTIONS)


def completions(**body: Any) -> Any:
    return convert("completions", {"model": SMOL, "prompt": "Once", **body}, OPTIONS)


def refused(api: str, body: dict[str, Any]) -> FieldRefusal:
    with pytest.raises(FieldRefusal) as info:
        convert(api, body, OPTIONS)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("fields, limit", [
    ({"max_completion_tokens": 5}, 5), ({"max_tokens": 12}, 12), ({"max_completion_tokens": 5, "max_tokens": 12}, 5),
    ({"max_completion_tokens": 12, "max_tokens": 5}, 5), ({"max_completion_tokens": None, "max_tokens": 7}, 7),
    ({}, None),
])
def test_max_completion_tokens_is_the_smaller_limit(fields: dict[str, Any], limit: int | None) -> None:
    assert chat(**fields).inference.max_tokens == limit


@pytest.mark.parametrize("value", [0, -1, 1.5, "5", True, 393_217])
def test_a_bad_max_completion_tokens_is_refused_by_name(value: Any) -> None:
    err = refused("chat", {"model": SMOL, "messages": [USER], "max_completion_tokens": value})
    assert err.field == "max_completion_tokens"
    assert err.message == "Invalid max_completion_tokens value, the valid range of max_completion_tokens is [1, 393216]"


def test_sampling_extensions_reach_the_sampling_params() -> None:
    extensions = {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 3, "ignore_eos": True}
    for prepared in (chat(max_tokens=10, temperature=0.5, **extensions), completions(max_tokens=10, **extensions)):
        sp = sampling_params(prepared.inference, 10, 42, [2, 0])
        assert sp == SamplingParams(max_tokens=10, temperature=prepared.inference.temperature, top_p=1.0, top_k=40,
                                    min_p=0.05, repetition_penalty=1.2, min_tokens=3, seed=42, stop_token_ids=[],
                                    ignore_eos=True)


def test_tokens_as_token_ids_is_read_by_chat_and_completions() -> None:
    for convert_one in (chat, completions):
        assert convert_one(logprobs=1 if convert_one is completions else True,
                           return_tokens_as_token_ids=True).inference.return_tokens_as_token_ids
        assert not convert_one().inference.return_tokens_as_token_ids


def test_penalties_and_logit_bias_reach_the_sampling_params() -> None:
    fields = {"presence_penalty": 0.5, "frequency_penalty": -1.25, "logit_bias": {"42": -100, "7": 2.5}}
    for prepared in (chat(max_tokens=10, **fields), completions(max_tokens=10, **fields)):
        sp = sampling_params(prepared.inference, 10, 42, [2])
        assert (sp.presence_penalty, sp.frequency_penalty, sp.logit_bias) == (0.5, -1.25, {42: -100.0, 7: 2.5})
    sp = sampling_params(chat().inference, 8, 1, [2])
    assert (sp.presence_penalty, sp.frequency_penalty, sp.logit_bias) == (0.0, 0.0, {})  # all off


@pytest.mark.parametrize("value, shown", [
    ([1, 2], "expected an object"), ("x", "expected an object"), ({"a": 1}, "key 'a'"), ({"-1": 1}, "key '-1'"),
    ({"1.5": 1}, "key '1.5'"), ({"2147483648": 1}, "key '2147483648'"), ({"1": 101}, "[-100, 100]"),
    ({"1": -100.5}, "[-100, 100]"), ({"1": "5"}, "[-100, 100]"), ({"1": True}, "[-100, 100]"),
    ({str(i): 1 for i in range(1025)}, "at most 1024"),
])
def test_a_bad_logit_bias_is_refused_by_name(value: Any, shown: str) -> None:
    for api, body in (("chat", {"model": SMOL, "messages": [USER]}), ("completions", {"model": SMOL, "prompt": "a"})):
        err = refused(api, {**body, "logit_bias": value})
        assert err.field == "logit_bias" and shown in err.message


def test_a_logit_bias_past_the_vocabulary_is_refused_by_name() -> None:
    prepared = chat(logit_bias={"49151": 1, "49152": 1})
    check_logit_bias(chat(logit_bias={"49151": 1}), 49152)
    with pytest.raises(FieldRefusal, match="49152': token id out of vocabulary") as err:
        check_logit_bias(prepared, 49152)
    assert err.value.field == "logit_bias"


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_a_penalty_out_of_range_is_the_reference_error(field: str) -> None:
    with pytest.raises(ConversionError, match=rf"Invalid {field} value, the valid range of {field} is \[-2, 2\]"):
        chat(**{field: 2.5})


def test_by_default_the_model_stops_on_its_end_of_sentence_ids() -> None:
    sp = sampling_params(chat().inference, 8, 1, {2, 0})
    assert sp.stop_token_ids == [0, 2] and not sp.ignore_eos
    assert (sp.top_k, sp.min_p, sp.repetition_penalty, sp.min_tokens) == (0, 0.0, 1.0, 0)  # all off


@pytest.mark.parametrize("top_k, sent", [(-1, 0), (0, 0), (1, 1), (50, 50)])
def test_top_k_off_is_minus_one_or_zero(top_k: int, sent: int) -> None:
    assert chat(top_k=top_k).inference.top_k == sent
    messages = {"model": SMOL, "max_tokens": 5, "messages": [USER], "top_k": top_k}
    assert convert("messages", messages, OPTIONS).inference.top_k == sent


@pytest.mark.parametrize("field, value", [
    ("top_k", -2), ("top_k", 1.5), ("top_k", "5"), ("top_k", 1 << 31), ("min_p", -0.1), ("min_p", 1.5),
    ("min_p", "0.1"), ("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", float("inf")),
    ("min_tokens", -1), ("min_tokens", 2.5), ("ignore_eos", 1), ("ignore_eos", "true"),
    ("return_tokens_as_token_ids", 1), ("return_tokens_as_token_ids", "yes"),
])
def test_bad_extension_values_are_refused_by_name(field: str, value: Any) -> None:
    for api, body in (("chat", {"model": SMOL, "messages": [USER]}), ("completions", {"model": SMOL, "prompt": "a"})):
        err = refused(api, {**body, field: value})
        assert err.field == field and field in err.message


def test_min_tokens_may_not_exceed_max_tokens() -> None:
    err = refused("chat", {"model": SMOL, "messages": [USER], "max_tokens": 4, "min_tokens": 5})
    assert err.field == "min_tokens" and err.message == "min_tokens (5) must be at most max_tokens (4)"
    assert chat(max_tokens=4, min_tokens=4).inference.min_tokens == 4
    default = chat(min_tokens=100)  # max_tokens defaults from the prompt's room: checked once it is known
    check_min_tokens(default, 100)
    with pytest.raises(FieldRefusal, match=r"min_tokens \(100\) must be at most max_tokens \(99"):
        check_min_tokens(default, 99)


@pytest.mark.parametrize("api, field, value", [
    ("chat", "stop_token_ids", [7]), ("chat", "use_beam_search", True), ("chat", "functions", [{"name": "f"}]),
    ("chat", "audio", {"voice": "x"}), ("chat", "modalities", ["text", "audio"]),
    ("chat", "skip_special_tokens", False), ("chat", "echo", True), ("chat", "prompt_logprobs", 1),
    ("completions", "response_format", {"type": "json_object"}),
    ("responses", "background", True), ("responses", "prompt", {"id": "p"}),
    ("messages", "mcp_servers", [{"url": "x"}]),
])
def test_fields_not_honoured_are_refused_by_name(api: str, field: str, value: Any) -> None:
    base = {"chat": {"messages": [USER]}, "completions": {"prompt": "a"}, "responses": {"input": "hi"},
            "messages": {"messages": [USER], "max_tokens": 5}}[api]
    err = refused(api, {"model": SMOL, **base, field: value})
    assert err.field == field and err.message.startswith(f"{field} is not supported: ")
    body = orjson.loads(api_error(api, err).body)
    if api == "messages":
        assert body == {"type": "error", "error": {"type": "invalid_request_error", "message": err.message}}
    else:
        assert body["error"]["param"] == field and body["error"]["message"] == err.message


@pytest.mark.parametrize("api, fields", [
    ("chat", {"logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "n": 1,
              "stop_token_ids": [], "use_beam_search": False, "skip_special_tokens": True, "modalities": ["text"],
              "response_format": {"type": "text"}, "repetition_penalty": 1.0, "top_k": -1, "min_p": 0,
              "user": "u", "metadata": {"a": "b"}, "store": False, "service_tier": "auto",
              "parallel_tool_calls": True, "stream": True,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("completions", {"logprobs": None, "presence_penalty": 0, "logit_bias": None, "n": 1, "best_of": 1,
                     "echo": False, "repetition_penalty": 1.0, "user": "u", "stop": None}),
    ("responses", {"top_logprobs": 0, "include": ["reasoning.encrypted_content"], "background": False,
                   "store": True, "previous_response_id": None, "metadata": {}, "truncation": "disabled"}),
    ("messages", {"metadata": {"user_id": "u"}, "service_tier": "auto", "mcp_servers": []}),
])
def test_neutral_and_harmless_values_pass(api: str, fields: dict[str, Any]) -> None:
    base = {"chat": {"messages": [USER]}, "completions": {"prompt": "a"}, "responses": {"input": "hi"},
            "messages": {"messages": [USER], "max_tokens": 5}}[api]
    convert(api, {"model": SMOL, **base, **fields}, OPTIONS)


@pytest.mark.parametrize("api, fields, count", [
    ("chat", {"logprobs": True}, 0), ("chat", {"logprobs": True, "top_logprobs": 5}, 5),
    ("chat", {"logprobs": False}, None), ("chat", {}, None),
    ("completions", {"logprobs": 0}, 0), ("completions", {"logprobs": 5}, 5), ("completions", {}, None),
    ("responses", {"top_logprobs": 3}, 3), ("responses", {"top_logprobs": 0}, 0),
    ("responses", {"include": ["message.output_text.logprobs"]}, 0),
    ("responses", {"include": ["message.output_text.logprobs"], "top_logprobs": 4}, 4),
    ("responses", {"include": ["reasoning.encrypted_content"]}, None),
])
def test_logprobs_reach_the_sampling_params(api: str, fields: dict[str, Any], count: int | None) -> None:
    base = {"chat": {"messages": [USER]}, "completions": {"prompt": "a"}, "responses": {"input": "hi"}}[api]
    prepared = convert(api, {"model": SMOL, **base, **fields}, OPTIONS)
    assert sampling_params(prepared.inference, 10, 1, [2]).logprobs == count


@pytest.mark.parametrize("api, fields, message", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "Invalid top_logprobs value, the valid range of top_logprobs "
                                                     "is [0, 20]."),
    ("chat", {"top_logprobs": 2}, "Invalid top_logprobs and logprobs value, logprobs must be set to true if "
                                  "top_logprobs is used."),
    ("completions", {"logprobs": 6}, "Invalid logprobs value, the valid range of logprobs is [0, 5]"),
    ("responses", {"top_logprobs": 21}, "Invalid top_logprobs value, the valid range of top_logprobs is [0, 20]."),
])
def test_logprobs_out_of_range_are_a_400(api: str, fields: dict[str, Any], message: str) -> None:
    base = {"chat": {"messages": [USER]}, "completions": {"prompt": "a"}, "responses": {"input": "hi"}}[api]
    with pytest.raises(ConversionError) as info:
        convert(api, {"model": SMOL, **base, **fields}, OPTIONS)
    assert (info.value.status, info.value.message) == (400, message)


def test_previous_response_id_and_store_are_left_to_the_responses_store() -> None:
    assert "previous_response_id" not in REFUSED["responses"] and "store" not in REFUSED["responses"]
    convert("responses", {"model": SMOL, "input": "hi", "previous_response_id": "resp_x", "store": True}, OPTIONS)


@pytest.mark.parametrize("model, role", [(SMOL, "system"), ("DeepSeek-V4.1-Flash", "system"),
                                         ("DeepSeek-V4-Pro", "user")])
def test_developer_messages_are_system_messages_but_on_v4(model: str, role: str) -> None:
    body = {"model": model, "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                                         USER], "thinking": {"type": "disabled"}}
    chat_roles = [(m.role, m.content) for m in convert("chat", body, OPTIONS).conversation.messages]
    assert chat_roles == [(role, "be brief"), ("user", "hi")]
    responses = {"model": model, "input": [{"role": "developer", "content": "be brief"}, USER],
                 "reasoning": {"effort": "none"}}
    assert [(m.role, m.content) for m in convert("responses", responses, OPTIONS).conversation.messages] == chat_roles


def test_unknown_roles_keep_the_references_words() -> None:
    with pytest.raises(ConversionError) as info:
        chat(messages=[{"role": "boss", "content": "x"}])
    assert info.value.message == ("invalid request body: unknown variant `boss`, expected one of `system`, `user`, "
                                  "`assistant`, `tool`, `latest_reminder`")


@pytest.mark.parametrize("api, body, where", [
    ("chat", {"messages": [USER, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[1].content[0] (image_url)"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                        {"type": "file", "file": {"file_id": "f"}}]}]},
     "messages[0].content[1] (file)"),
    ("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "text", "media_type": "text/plain", "data": "d"}}]}]}, "messages.0.content.0 (document)"),
    ("messages", {"max_tokens": 5, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "url", "url": "u"}}]}]}],
      "tools": [{"name": "f", "input_schema": {"type": "object"}}], "thinking": {"type": "disabled"}},
     "messages.2.content.0.content.0 (image)"),
    ("responses", {"input": [USER, {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[1].content[0] (input_file)"),
])
def test_image_and_file_input_is_refused_for_text_models(api: str, body: dict[str, Any], where: str) -> None:
    for model in ("DeepSeek-V4-Pro", SMOL):
        if model == SMOL and "tools" in body:
            continue  # chat templates refuse tools first
        err = refused(api, {"model": model, **body})
        assert err.field is None
        assert err.message == f"{where}: image and file input is not supported: model {model} reads text only"


TABLE = TokenTable(token_bytes=(b"Hi", b" there", b"!", b"<eos>"), added={}, eos_ids=frozenset({3}))


@pytest.mark.parametrize("ignore_eos, content, count", [(False, "Hi", 2), (True, "Hi there!", 4)])
def test_ignore_eos_goes_on_past_the_end_of_sentence(ignore_eos: bool, content: str, count: int) -> None:
    prepared = chat(ignore_eos=ignore_eos)
    prepared = replace(prepared, encoding="v4", stream=False)  # the table above spells every id as text
    p = OutputProcessor(prepared, response_id="rid", created=0, tokens=TABLE)
    p.push(Ready(1))
    p.push(Tokens([0, 3, 1, 2]))
    p.finish()
    body = orjson.loads(p.body())
    assert body["choices"][0]["message"]["content"].replace("<eos>", "") == content
    assert body["usage"]["completion_tokens"] == count


# --- the reasoning budget (thinking.budget_tokens) ------------------------------------------------------------------


@pytest.mark.parametrize("api, body", [
    ("messages", {"max_tokens": 100, "messages": [USER], "thinking": {"type": "enabled", "budget_tokens": 50}}),
    ("chat", {"max_tokens": 100, "messages": [USER], "thinking": {"type": "enabled", "budget_tokens": 50}}),
])
def test_budget_tokens_reaches_the_engine_as_a_forced_end_of_thinking(api: str, body: dict[str, Any]) -> None:
    prepared = convert(api, {"model": "DeepSeek-V4-Pro", **body}, OPTIONS)
    assert prepared.inference.reasoning_budget == 50
    sp = sampling_params(prepared.inference, 100, 1, [2], reasoning_end=7)
    assert (sp.reasoning_budget, sp.reasoning_end) == (50, 7)
    # a budget the answer cannot reach, or no end token to force (no thinking): nothing is forced
    for max_tokens, end in ((50, 7), (100, None)):
        sp = sampling_params(prepared.inference, max_tokens, 1, [2], reasoning_end=end)
        assert (sp.reasoning_budget, sp.reasoning_end) == (-1, -1)
    off = convert(api, {"model": "DeepSeek-V4-Pro", **body, "thinking": {"type": "disabled", "budget_tokens": 50}},
                  OPTIONS)
    assert off.inference.reasoning_budget is None  # no reasoning, no budget
