"""Structured output: the constraint a request's output must match, from its API fields, and its wire form for the
engine (shared/schemas/generate.py Constraint; shared/engine/grammar.py enforces it).

    response_format json_schema / json_object / regex (Chat), text.format (Responses)   the API converters
    structured_outputs {json | regex | choice | grammar | json_object}                   vLLM's extension (Chat,
    guided_json, guided_regex, guided_choice, guided_grammar                             Completions), read here
    output_format {"type": "json_schema", "schema": ...}                                 Anthropic Messages, here

One constraint per request: two sources (response_format and structured_outputs, or two keys of it) are a 400, as
vLLM refuses them; so is one next to tools (the tool choice constrains the output: its call markup, dsml_grammar.py
for DeepSeek formats, hermes_grammar.py for chat-template models).
`choice` becomes an EBNF grammar of its literal strings. In thinking mode the constraint starts after the
end-of-thinking token (the reasoning is free, and a schema answer never lands in `reasoning_content`); continuing an
assistant prefix that already has content is refused (the grammar would see only the continuation), except with
tools, whose grammar fits a continuation: free text goes on (auto), or the prompt opened the block (required).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from services.recipe.convert import common
from services.recipe.errors import ConversionError, FieldRefusal
from services.recipe.formats import dsml_grammar, hermes, hermes_grammar
from services.recipe.formats.deepseek import FORMATS
from services.recipe.formats.dsml import CONTROL_TOKENS, DSML, END_THINK
from services.recipe.formats.dsml_grammar import Mode
from services.recipe.prepared import Api, OutputConstraint, PreparedRequest
from shared.schemas.generate import Constraint

FIELD = "structured_outputs"
LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
KINDS = ("json", "regex", "choice", "grammar", "json_object")
APIS: tuple[Api, ...] = ("chat", "completions")  # where the vLLM fields are read (elsewhere refused by fields.py)
ANTHROPIC = "output_format"


def apply(api: Api, body: Any, prepared: PreparedRequest) -> PreparedRequest:
    """`prepared` with the constraint of vLLM's fields (or Anthropic's output_format), if the body has any
    (FieldRefusal for a bad one)."""
    if not isinstance(body, dict) or (api not in APIS and api != "messages"):
        return prepared
    asked = _asked(body) if api in APIS else _anthropic(body)
    if not asked:
        return prepared
    (name, kind, value), *more = asked
    if more:
        raise FieldRefusal(f"only one structured output constraint per request, got {len(asked)} "
                           f"({', '.join(n for n, _, _ in asked)})", name.split(".")[0])
    if prepared.inference.output_constraint is not None or prepared.conversation.response_format.kind != "text":
        why = "tools" if prepared.conversation.offers_tools else "response_format"
        raise FieldRefusal(f"{name} cannot be combined with {why}", name.split(".")[0])
    constraint = _read(name, kind, value)
    return replace(prepared, inference=replace(prepared.inference, output_constraint=constraint))


def _asked(body: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(the field's name as the client spelled it, its kind, its value) for every constraint the body sends."""
    asked = [(legacy, kind, body[legacy]) for legacy, kind in LEGACY.items() if body.get(legacy) is not None]
    outer = body.get(FIELD)
    if outer is None:
        return asked
    if not isinstance(outer, dict):
        raise FieldRefusal(f"{FIELD} must be an object with one of {', '.join(KINDS)}", FIELD)
    for key, value in outer.items():
        if value is None or (key == "json_object" and value is False):
            continue
        if key not in KINDS:
            raise FieldRefusal(f"{FIELD}.{key} is not supported (one of {', '.join(KINDS)})", FIELD)
        asked.append((f"{FIELD}.{key}", key, value))
    return asked


def _anthropic(body: dict[str, Any]) -> list[tuple[str, str, Any]]:
    fmt = body.get(ANTHROPIC)
    if fmt is None:
        return []
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
        raise FieldRefusal(f'{ANTHROPIC} must be {{"type": "json_schema", "schema": {{...}}}}', ANTHROPIC)
    return [(ANTHROPIC, "json", fmt["schema"])]


def _read(name: str, kind: str, value: Any) -> OutputConstraint:
    field = name.split(".")[0]
    if kind == "json_object":
        if value is not True:
            raise FieldRefusal(f"{name} must be true", field)
        return OutputConstraint("json", "")
    if kind == "json":
        if isinstance(value, str):  # vLLM takes the schema as an object or as its JSON text
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise FieldRefusal(f"{name} is not a JSON schema: {exc}", field) from None
        if not isinstance(value, dict):
            raise FieldRefusal(f"{name} must be a JSON schema (an object)", field)
        try:
            _, text = common.response_schema(value, False)
        except ConversionError as exc:
            raise FieldRefusal(f"{name}: {exc.message}", field) from None
        return OutputConstraint("json", text)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise FieldRefusal(f"{name} must be a non-empty list of non-empty strings", field)
        # JSON's string escapes are the EBNF's: each choice is one literal
        return OutputConstraint("grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    if not isinstance(value, str) or not value:
        raise FieldRefusal(f"{name} must be a non-empty string", field)
    return OutputConstraint("regex" if kind == "regex" else "grammar", value)


# --- the wire form ----------------------------------------------------------------------------------------------


def check(prepared: PreparedRequest) -> None:
    """What the engine cannot honour, refused before the request is sent: a constraint continuing a prefix."""
    if wire_kind(prepared.inference.output_constraint) in (None, "structural_tag"):
        return
    if prepared.parsing.thinking_initial_stage == "content_continuation" or _continues_content(prepared):
        raise FieldRefusal("a constrained output cannot continue an assistant prefix that already has content",
                           "response_format")


def _continues_content(prepared: PreparedRequest) -> bool:
    conv = prepared.conversation
    return bool(conv.continues_prefix and conv.messages and conv.messages[-1].content)


def wire_kind(oc: OutputConstraint | None) -> str | None:
    """The engine's constraint kind for the recipe's (None: not constrained)."""
    if oc is None:
        return None
    if oc.kind == "json":
        return "json_schema" if oc.schema else "json_object"
    if oc.kind in TOOL_MODES:
        return "structural_tag"
    return oc.kind if oc.kind in ("regex", "grammar") else None


# the recipe's tool-call constraint kinds -> dsml_grammar's modes: "tool_call_required" is a required or named
# choice (the prompt opened the block); "tool_call" is auto, or "must_call" with OutputConstraint.must_call
TOOL_MODES: dict[str, Mode] = {"tool_call": "auto", "tool_call_required": "required"}


def wire(prepared: PreparedRequest, end_think: int | None,
         token_id: Callable[[str], int | None] | None = None) -> Constraint | None:
    """The engine's constraint. end_think: the model's end-of-thinking token id, which opens the grammar in
    thinking mode (the reasoning before it is free); token_id: the served tokenizer's id of a token's text (a tool
    call's markup names its marker by id)."""
    oc = prepared.inference.output_constraint
    kind = wire_kind(oc)
    if kind is None:
        return None
    assert oc is not None
    thinking = prepared.parsing.thinking_initial_stage in ("reasoning_start", "reasoning_continuation")
    if thinking and end_think is None:
        raise FieldRefusal(f"the model has no {END_THINK} token: a constrained output needs thinking off",
                           "response_format")
    after = end_think if thinking and end_think is not None else -1
    if kind == "structural_tag":
        return _tool_calls(prepared, "must_call" if oc.must_call else TOOL_MODES[oc.kind], after, token_id)
    return Constraint(kind, oc.schema, after)  # type: ignore[arg-type]


def one_call(prepared: PreparedRequest, parallel: bool | None) -> PreparedRequest:
    """`prepared` whose tool calls are at most one when the client said so (parallel_tool_calls false, Anthropic's
    disable_parallel_tool_use true: `parallel` False)."""
    oc = prepared.inference.output_constraint
    if parallel is not False or oc is None or oc.kind not in TOOL_MODES:
        return prepared
    return replace(prepared, inference=replace(prepared.inference, output_constraint=replace(oc, one_call=True)))


def _tool_calls(prepared: PreparedRequest, mode: Mode, after: int,
                token_id: Callable[[str], int | None] | None) -> Constraint | None:
    """A tool choice's constraint: the format's call markup with each tool's arguments (DSML for DeepSeek formats,
    Hermes for chat-template models; None where the format's marker is not in the served vocabulary)."""
    oc = prepared.inference.output_constraint
    parallel = oc is None or not oc.one_call
    tools = prepared.conversation.tools
    if prepared.encoding == "chat_template":
        ids = [token_id(t) if token_id is not None else None for t in (hermes.CALL_OPEN, hermes.CALL_CLOSE)]
        return Constraint("structural_tag", hermes_grammar.spec(tools, mode, *ids, parallel=parallel), after)
    fmt = FORMATS.get(prepared.encoding)
    dsml_id = token_id(DSML) if token_id is not None else None
    if fmt is None or dsml_id is None:
        return None
    others = (token_id(t) for t in CONTROL_TOKENS if t != DSML)
    excludes = sorted({i for i in others if i is not None})
    spec = dsml_grammar.structural_tag(fmt.tags, tools, mode, dsml_id, excludes, parallel)
    return Constraint("structural_tag", spec, after)
