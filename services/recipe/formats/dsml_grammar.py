"""The grammar of a DSML tool call (services/recipe/formats/dsml.py), as an xgrammar structural tag: what a
`tool_choice` constrains the output to (shared/engine/grammar.py compiles and enforces it).

    required / named   the prompt already opened the block (V4.prompt: Tags.open_block):
                       invoke ("\n" invoke)* "\n</｜DSML｜tool_calls>"   (one invoke without parallel_tool_calls)
    must call          (Anthropic "any": the prompt is the reference's "auto" one) the block, then as above
    auto               any text; once "｜DSML｜" comes, the rest is one whole block, then the end

    invoke     <｜DSML｜invoke name="NAME">\n  parameter*  </｜DSML｜invoke>
    parameter  <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>\n      (a string property)
               <｜DSML｜parameter name="KEY" string="false">JSON value</｜DSML｜parameter>\n  (any other)

Every literal is built from the format's `Tags` and `dsml.DSML`, the strings the prompt renders past calls with and
the stream parser reads (parse/stages.py). The marker `｜DSML｜` is a token of its own: the parser reads it by id
(token mode), so the grammar names it by id too ({"type": "token"}); the engine's vocabulary gives such tokens no
text, so no run of ordinary tokens can spell one under the grammar.

The arguments follow the tool's JSON schema: its properties in schema order, required ones present, optional
ones maybe; a string property's raw text matches its enum, pattern or length bounds; any other value is JSON of its
schema. A tool whose schema names no properties takes any parameters. Each invoke carries {"tool": NAME}, a key
xgrammar ignores, so the engine can name the tool whose schema it cannot compile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from services.recipe.formats.dsml import BLOCK_LEAD, Tags
from services.recipe.formats.tag_grammar import Format, labelled
from services.recipe.formats.tag_grammar import json_value as _json_value
from services.recipe.formats.tag_grammar import lit as _lit
from services.recipe.formats.tag_grammar import regex as _regex
from services.recipe.formats.tag_grammar import seq as _seq
from services.recipe.formats.tag_grammar import structural_tag as _spec
from services.recipe.formats.tag_grammar import token as _token
from services.recipe.prepared import ToolSpec

Mode = Literal["required", "must_call", "auto"]

_ANY_TEXT = "[\\s\\S]*"
_KEY = '[^"\\s]+'  # a parameter name of a schema without properties: the parser ends it at '" '


def structural_tag(tags: Tags, tools: Sequence[ToolSpec], mode: Mode, dsml_id: int,
                   text_excludes: Sequence[int] = (), parallel: bool = True) -> str:
    """The structural tag (JSON text) for these tools. `dsml_id`: the id of the `｜DSML｜` token;
    `text_excludes`: token ids that free text (auto) may not contain (the format's other control tokens);
    `parallel`: more than one call may follow (parallel_tool_calls), else exactly one."""
    m = _Markup(tags, dsml_id)
    invokes = [_invoke(m, t) for t in tools]
    one = invokes[0] if len(invokes) == 1 else {"type": "or", "elements": invokes}
    more = [{"type": "star", "content": _seq(_lit("\n"), one)}] if parallel else []
    calls = _seq(one, *more, _lit("\n"), *m.close(tags.block))
    if mode == "required":
        fmt = calls
    elif mode == "must_call":
        fmt = _seq(_lit(BLOCK_LEAD), *m.open(tags.block, ">\n"), calls)
    else:
        # after the marker token: the rest of the block's opening, the calls, and nothing after the block
        block = _seq(_lit(f"{tags.block}>\n"), *_without_last(calls))
        fmt = {"type": "token_triggered_tags", "trigger_tokens": [dsml_id], "exclude_tokens": list(text_excludes),
               "tags": [{"type": "tag", "begin": _token(dsml_id), "content": block, "end": f"{tags.block}>"}],
               "stop_after_first": True}
    return _spec(fmt)


class _Markup:
    """The DSML tags of one format, with the marker as its token."""

    def __init__(self, tags: Tags, dsml_id: int) -> None:
        self.tags, self.dsml = tags, _token(dsml_id)

    def open(self, tag: str, attributes: str = "") -> list[Format]:
        """<｜DSML｜tag attributes  (the caller closes the tag's bracket)"""
        return [_lit("<"), self.dsml, _lit(f"{tag}{attributes}")]

    def close(self, tag: str) -> list[Format]:
        return [_lit("</"), self.dsml, _lit(f"{tag}>")]


def _invoke(m: _Markup, tool: ToolSpec) -> Format:
    invoke = m.tags.invoke
    opening = m.open(invoke, f' name="{tool.name}">\n')
    return labelled(_seq(*opening, _arguments(m, tool.parameters), *m.close(invoke)), tool.name)


def _arguments(m: _Markup, schema: Any) -> Format:
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict) or not properties:
        return {"type": "star", "content": _any_parameter(m)}
    required = set(schema.get("required") or ())
    # a property's schema is compiled on its own: it keeps the root's definitions its $refs point into
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    params = []
    for key, value in properties.items():
        p = _parameter(m, key, {**defs, **value} if defs and isinstance(value, dict) else value)
        params.append(p if key in required else {"type": "optional", "content": p})
    return _seq(*params)


def _parameter(m: _Markup, key: str, schema: Any) -> Format:
    tag = m.tags.parameter
    string = _is_string(schema)  # (a $ref to a string is written as JSON: string="false", a quoted string)
    value = _string_value(schema) if string else _json_value(schema)
    return _seq(*m.open(tag, f' name="{key}" string="{"true" if string else "false"}">'), value, *m.close(tag),
                _lit("\n"))


def _any_parameter(m: _Markup) -> Format:
    tag = m.tags.parameter
    kinds = {"type": "or", "elements": [_seq(_lit('true">'), _regex(_ANY_TEXT)),
                                        _seq(_lit('false">'), _json_value(True))]}
    return _seq(*m.open(tag, ' name="'), _regex(_KEY), _lit('" string="'), kinds, *m.close(tag), _lit("\n"))


def _is_string(schema: Any) -> bool:
    """Written as is (string="true"): a property that can only be a string, as the renderer writes a str value."""
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string" or schema.get("type") == ["string"]:
        return True
    choices = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else []
    return "type" not in schema and bool(choices) and all(isinstance(c, str) for c in choices)


def _string_value(schema: dict[str, Any]) -> Format:
    choices = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else []
    if choices:
        return {"type": "or", "elements": [_lit(c) for c in choices if isinstance(c, str)]}
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        return _regex(pattern.removeprefix("^").removesuffix("$"))
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if isinstance(high, int) or (isinstance(low, int) and low > 0):
        return _regex(f"[\\s\\S]{{{int(low)},{'' if high is None else int(high)}}}")
    return _regex(_ANY_TEXT)


def _without_last(seq: Format) -> list[Format]:
    """A sequence's elements but its last (the block's closing "tool_calls>", which becomes a tag's end)."""
    return seq["elements"][:-1]
