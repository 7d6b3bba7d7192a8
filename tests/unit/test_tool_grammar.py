"""Tool calls under a grammar (services/recipe/formats/dsml_grammar.py, compiled by shared/engine/grammar.py) with the
real DeepSeek V4 vocabulary: the grammar of each tool choice accepts the call the format itself renders (the prompt's
own past-call markup, encoded to the tokenizer's tokens) and refuses arguments outside the tool's schema; markup
tokens cannot be spelled by ordinary tokens; a schema the grammar engine cannot use names its tool; the recipe sends
each tool choice as its constraint (Chat, Responses, Anthropic), opened after </think> in thinking mode."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from services.recipe.conversation import Conversation, Message, ToolCall
from services.recipe.convert import ConvertOptions, convert
from services.recipe.convert.structured import wire
from services.recipe.formats.deepseek import FORMATS
from services.recipe.formats.dsml import DSML, END_THINK
from services.recipe.formats.dsml_grammar import Mode, structural_tag
from services.recipe.prepared import ToolSpec
from shared.engine.api import RequestError
from shared.engine.grammar import Grammars, vocabulary
from shared.schemas.generate import Constraint
from shared.tokenizer import Tokenizer

WEATHER = ToolSpec("get_weather", None, {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                     "note": {"type": "string", "maxLength": 8}},
    "required": ["city", "days"], "additionalProperties": False})
ANYTHING = ToolSpec("log", None, {})  # no properties: any parameters


@pytest.fixture(scope="module")
def v4() -> Tokenizer:
    from shared.deepseek_tokenizer import load_deepseek_tokenizer

    return load_deepseek_tokenizer()


@pytest.fixture(scope="module")
def grammars(v4: Tokenizer) -> Grammars:
    size = v4.vocab_size
    return Grammars(size, lambda: vocabulary(v4.token_bytes, v4.is_special, size, v4.markup_ids), torch.device("cpu"))


def rendered_block(encoding: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The tool-call block exactly as the format renders a past assistant turn's calls."""
    tool_calls = tuple(ToolCall(f"c{i}", name, json.dumps(args)) for i, (name, args) in enumerate(calls))
    conv = Conversation((Message("user", "hi"), Message("assistant", "", tool_calls=tool_calls)), thinking=False)
    prompt, tag = FORMATS[encoding].render(conv).prompt, FORMATS[encoding].tags.block
    start, close = prompt.index(f"\n\n<{DSML}{tag}>"), f"</{DSML}{tag}>"
    return prompt[start : prompt.index(close) + len(close)]


def accepts(g: Grammars, v4: Tokenizer, encoding: str, mode: Mode, output: str, tools=(WEATHER,)) -> bool:
    """Whether the whole output, then an end-of-sentence token, is what the grammar allows."""
    spec = structural_tag(FORMATS[encoding].tags, tools, mode, v4.token_id(DSML), [v4.token_id(END_THINK)])
    g.add("t", Constraint("structural_tag", spec), sorted(v4.eos_ids), [])
    try:
        state = g.states["t"]
        return all(state.advance(t) for t in v4.encode(output)) and state.advance(min(v4.eos_ids))
    finally:
        g.drop("t")


GOOD = ("get_weather", {"city": "Paris", "days": 3})


@pytest.mark.parametrize("encoding", ["v4", "v41"])
def test_the_rendered_call_is_what_each_tool_choice_accepts(grammars: Grammars, v4: Tokenizer, encoding: str) -> None:
    block = rendered_block(encoding, [GOOD, ("get_weather", {"city": "Rome", "days": 7, "note": "rain"})])
    opened = FORMATS[encoding].tags.open_block()
    assert block.startswith(opened)
    assert accepts(grammars, v4, encoding, "required", block.removeprefix(opened))  # the prompt opened the block
    assert accepts(grammars, v4, encoding, "must_call", block)
    assert accepts(grammars, v4, encoding, "auto", "Let me check." + block)
    assert accepts(grammars, v4, encoding, "auto", "It is sunny.")  # auto: text alone
    assert not accepts(grammars, v4, encoding, "must_call", "It is sunny.")
    assert not accepts(grammars, v4, encoding, "auto", block + "\nmore text")  # nothing after the block


@pytest.mark.parametrize("arguments", [{"city": "Berlin", "days": 3}, {"city": "Paris", "days": 9}, {"days": 3},
                                       {"city": "Paris", "days": 3, "note": "far too long a note"},
                                       {"city": "Paris", "days": "3"}])
def test_arguments_outside_the_schema_are_refused(grammars: Grammars, v4: Tokenizer, arguments: dict) -> None:
    block = rendered_block("v4", [("get_weather", arguments)])
    assert not accepts(grammars, v4, "v4", "must_call", block)
    assert not accepts(grammars, v4, "v4", "auto", block)
    assert not accepts(grammars, v4, "v4", "must_call", rendered_block("v4", [("get_time", {})]))  # not offered


def test_a_tool_without_properties_takes_any_parameters(grammars: Grammars, v4: Tokenizer) -> None:
    block = rendered_block("v4", [("log", {"text": "a </b> tag", "level": 2, "tags": ["x"]})])
    assert accepts(grammars, v4, "v4", "must_call", block, tools=(WEATHER, ANYTHING))


def test_a_property_keeps_the_definitions_its_ref_points_into(grammars: Grammars, v4: Tokenizer) -> None:
    place = {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"],
             "additionalProperties": False}
    tool = ToolSpec("goto", None, {"type": "object", "$defs": {"place": place},
                                   "properties": {"to": {"$ref": "#/$defs/place"}}, "required": ["to"]})
    assert accepts(grammars, v4, "v4", "must_call", rendered_block("v4", [("goto", {"to": {"lat": 1.5}})]), (tool,))
    assert not accepts(grammars, v4, "v4", "must_call", rendered_block("v4", [("goto", {"to": {"lon": 1}})]), (tool,))


def test_the_marker_is_its_token_never_its_spelling(grammars: Grammars, v4: Tokenizer) -> None:
    block = rendered_block("v4", [GOOD])
    ids = v4.encode(block)
    dsml = v4.token_id(DSML)
    spelled = [p for i in ids for p in (v4.encode("｜") + v4.encode("DSML｜") if i == dsml else [i])]
    assert dsml in ids and dsml not in spelled and v4.decode(spelled) == v4.decode(ids)
    spec = structural_tag(FORMATS["v4"].tags, (WEATHER,), "must_call", dsml)
    grammars.add("s", Constraint("structural_tag", spec), sorted(v4.eos_ids), [])
    state = grammars.states["s"]
    assert not all(state.advance(t) for t in spelled)
    grammars.drop("s")


def test_a_schema_the_grammar_engine_cannot_use_names_its_tool(grammars: Grammars, v4: Tokenizer) -> None:
    bad = ToolSpec("lookup", None, {"type": "object", "properties": {"q": {"type": "object", "pattern": 1,
                                                                           "properties": {"r": {"type": "strin"}}}}})
    spec = structural_tag(FORMATS["v4"].tags, (WEATHER, bad), "auto", v4.token_id(DSML))
    with pytest.raises(RequestError, match="tool 'lookup'"):
        grammars.add("b", Constraint("structural_tag", spec), sorted(v4.eos_ids), [])


# --- the recipe sends it ---------------------------------------------------------------------------------------

PRO = "DeepSeek-V4-Pro"
OPTIONS = ConvertOptions(models={PRO: "v4"})
IDS = {DSML: 128825, END_THINK: 128822}
OAI = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}},
       {"type": "function", "function": {"name": "log", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def constraint(api: str, body: dict[str, Any]) -> Constraint | None:
    return wire(convert(api, {"model": PRO, **body}, OPTIONS), IDS[END_THINK], IDS.get)


def invoked(c: Constraint | None) -> list[str]:
    """The tools a constraint's calls may name."""
    assert c is not None and c.kind == "structural_tag"
    return sorted(set(_tools(json.loads(c.spec))))


def _tools(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [node["tool"]] if "tool" in node else [t for v in node.values() for t in _tools(v)]
    return [t for v in node for t in _tools(v)] if isinstance(node, list) else []


def test_each_tool_choice_becomes_its_constraint() -> None:
    off = {"thinking": {"type": "disabled"}}
    named = constraint("chat", {"messages": ASK, "tools": OAI, **off,
                                "tool_choice": {"type": "function", "function": {"name": "log"}}})
    assert invoked(named) == ["log"] and named.after_token == -1
    assert '"trigger_tokens"' not in named.spec  # required: the prompt opened the block, a call follows
    auto = constraint("chat", {"messages": ASK, "tools": OAI})  # thinking (V4's default): opened by </think>
    assert invoked(auto) == ["get_weather", "log"] and auto.after_token == IDS[END_THINK]
    assert '"trigger_tokens"' in auto.spec
    assert constraint("chat", {"messages": ASK, "tools": OAI, "tool_choice": "none"}) is None
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    both = constraint("chat", {"messages": ASK, "tools": OAI, **off, "tool_choice": "required",
                               "response_format": schema})
    assert invoked(both) == ["get_weather", "log"]  # with a response_format the tool choice wins (as vLLM)
    responses = constraint("responses", {"input": "Weather?", "reasoning": {"effort": "none"},
                                         "tools": [{"type": "function", **o["function"]} for o in OAI],
                                         "tool_choice": {"type": "function", "name": "get_weather"}})
    assert invoked(responses) == ["get_weather"]
    claude = {"max_tokens": 9, "messages": ASK, "tools": [{"name": "get_weather", "input_schema": WEATHER.parameters}]}
    anyone = constraint("messages", {**claude, "tool_choice": {"type": "any"}})
    assert invoked(anyone) == ["get_weather"] and anyone.after_token == IDS[END_THINK]
    assert json.dumps(FORMATS["v4"].tags.block + ">\n")[1:-1] in anyone.spec and '"trigger_tokens"' not in anyone.spec
    one = constraint("messages", {**claude, "thinking": {"type": "disabled"},
                                  "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert invoked(one) == ["get_weather"] and one.after_token == -1


def test_without_parallel_tool_calls_one_call_is_all(grammars: Grammars, v4: Tokenizer) -> None:
    def takes(c: Constraint | None, output: str) -> bool:
        assert c is not None
        grammars.add("p", c, sorted(v4.eos_ids), [])
        state = grammars.states["p"]
        try:
            return all(state.advance(t) for t in v4.encode(output)) and state.advance(min(v4.eos_ids))
        finally:
            grammars.drop("p")

    opened = FORMATS["v4"].tags.open_block()
    one, two = (rendered_block("v4", calls).removeprefix(opened) for calls in ([GOOD], [GOOD, GOOD]))
    body = {"messages": ASK, "tools": OAI, "tool_choice": "required", "thinking": {"type": "disabled"}}
    assert takes(constraint("chat", body), one) and takes(constraint("chat", body), two)
    single = constraint("chat", {**body, "parallel_tool_calls": False})
    assert takes(single, one) and not takes(single, two)
    claude = {"max_tokens": 9, "messages": ASK, "tools": [{"name": "get_weather", "input_schema": WEATHER.parameters}],
              "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "thinking": {"type": "disabled"}}
    once = constraint("messages", claude)
    assert takes(once, opened + one) and not takes(once, opened + two)
    resp = {"input": "Weather in Paris?", "reasoning": {"effort": "none"}, "tool_choice": "required",
            "tools": [{"type": "function", **o["function"]} for o in OAI]}
    assert takes(constraint("responses", resp), two)
    single = constraint("responses", {**resp, "parallel_tool_calls": False})
    assert takes(single, one) and not takes(single, two)


def test_responses_reports_and_checks_parallel_tool_calls() -> None:
    from services.recipe.emit.responses import ResponsesEmitter
    from services.recipe.errors import FieldRefusal

    body = {"model": PRO, "input": "hi", "parallel_tool_calls": False}
    echo = convert("responses", body, OPTIONS).echo
    emitter = ResponsesEmitter("resp_x", PRO, 0, stream=False, echo=echo)
    assert emitter._object("completed", [], None, None, None)["parallel_tool_calls"] is False
    default = convert("responses", {"model": PRO, "input": "hi"}, OPTIONS).echo
    assert ResponsesEmitter("resp_y", PRO, 0, stream=False, echo=default)._object(
        "completed", [], None, None, None)["parallel_tool_calls"] is True
    with pytest.raises(FieldRefusal, match="parallel_tool_calls"):
        convert("responses", {**body, "parallel_tool_calls": "no"}, OPTIONS)
