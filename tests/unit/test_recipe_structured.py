"""Structured output on the recipe's side (services/recipe/convert/structured.py): response_format and vLLM's
structured_outputs / guided_* fields become one engine Constraint; conflicts and bad values are 400s by name; in
thinking mode the constraint opens after </think>."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.recipe.convert import ConvertOptions, convert
from services.recipe.convert.structured import check, wire
from services.recipe.errors import FieldRefusal
from shared import codec
from shared.schemas.generate import Constraint, GenerateRequest, SamplingParams

SMOL = "SmolLM2-135M-Instruct"
PRO = "DeepSeek-V4-Pro"
OPTIONS = ConvertOptions(models={SMOL: "chat_template", PRO: "v4"})
USER = {"role": "user", "content": "answer in json"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
END_THINK = 128822  # any id: stands for the model's </think>


def chat(**body: Any) -> Any:
    return convert("chat", {"model": SMOL, "messages": [USER], **body}, OPTIONS)


def refused(api: str, body: dict[str, Any]) -> FieldRefusal:
    with pytest.raises(FieldRefusal) as info:
        convert(api, body, OPTIONS)
    return info.value


@pytest.mark.parametrize("body, expected", [
    ({"response_format": {"type": "json_object"}}, Constraint("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ({"response_format": {"type": "regex", "regex": "[a-z]+"}}, Constraint("regex", "[a-z]+")),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, Constraint("regex", "[0-9]{3}")),
    ({"structured_outputs": {"json": SCHEMA}}, Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}},
     Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ({"structured_outputs": {"json_object": True}}, Constraint("json_object")),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, Constraint("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"choice": ["yes", 'say "no"']}}, Constraint("grammar", 'root ::= "yes" | "say \\"no\\""')),
    ({"guided_choice": ["a", "b"]}, Constraint("grammar", 'root ::= "a" | "b"')),
    ({"guided_regex": "x+"}, Constraint("regex", "x+")),
    ({"guided_json": SCHEMA}, Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ({"guided_grammar": 'root ::= "b"'}, Constraint("grammar", 'root ::= "b"')),
    ({}, None),
    ({"structured_outputs": {"json_object": False}}, None),
])
def test_each_source_becomes_one_engine_constraint(body: dict, expected: Constraint | None) -> None:
    prepared = chat(**body)
    check(prepared)
    assert wire(prepared, None) == expected
    sp = SamplingParams(constraint=expected)  # and it crosses the bus intact
    req = GenerateRequest("r", SMOL, [1], sp)
    assert codec.decode(GenerateRequest, codec.encode(req)).sampling.constraint == expected


def test_completions_read_the_vllm_fields() -> None:
    prepared = convert("completions", {"model": SMOL, "prompt": "x", "structured_outputs": {"regex": "a|b"}},
                       OPTIONS)
    assert wire(prepared, None) == Constraint("regex", "a|b")


@pytest.mark.parametrize("extra, field, words", [
    ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs", "only one"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex", "only one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "response_format"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs", "non-empty string"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not a JSON schema"),
    ({"structured_outputs": {"json": {"type": "objekt"}}}, "structured_outputs", "Invalid json schema"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs", "must be true"),
    ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs", "not supported"),
    ({"structured_outputs": "json"}, "structured_outputs", "must be an object"),
    ({"guided_regex": "a", "tools": [{"type": "function", "function": {"name": "f"}}]}, "guided_regex", "tools"),
])
def test_bad_or_conflicting_constraints_are_refused_by_name(extra: dict, field: str, words: str) -> None:
    err = refused("chat", {"model": SMOL, "messages": [USER], **extra})
    assert err.field == field and words in err.message


def test_thinking_opens_the_grammar_after_the_end_of_thinking_token() -> None:
    body = {"model": PRO, "messages": [USER], "thinking": {"type": "enabled"},
            "response_format": {"type": "json_object"}}
    prepared = convert("chat", body, OPTIONS)
    assert wire(prepared, END_THINK) == Constraint("json_object", "", END_THINK)
    with pytest.raises(FieldRefusal, match="</think>"):
        wire(prepared, None)
    off = convert("chat", {**body, "thinking": {"type": "disabled"}}, OPTIONS)
    assert wire(off, END_THINK) == Constraint("json_object")


def test_a_constraint_cannot_continue_a_prefix_with_content() -> None:
    prefix = {"role": "assistant", "content": '{"a": ', "prefix": True}
    prepared = convert("chat", {"model": SMOL, "messages": [USER, prefix], "structured_outputs": {"regex": "1"}},
                       OPTIONS)
    with pytest.raises(FieldRefusal, match="prefix"):
        check(prepared)
    check(convert("chat", {"model": SMOL, "messages": [USER, prefix]}, OPTIONS))  # unconstrained: fine


def test_anthropic_output_format_is_a_json_schema_constraint() -> None:
    body = {"model": SMOL, "max_tokens": 20, "messages": [USER]}
    prepared = convert("messages", {**body, "output_format": {"type": "json_schema", "schema": SCHEMA}}, OPTIONS)
    assert wire(prepared, None) == Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
    for bad in ({"type": "json_schema"}, {"type": "text"}, "json"):
        assert refused("messages", {**body, "output_format": bad}).field == "output_format"
    assert wire(convert("messages", body, OPTIONS), None) is None
