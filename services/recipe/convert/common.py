"""Conversion rules every API shares: thinking and reasoning effort, sampling, tools and tool choice, output
constraints, parsing settings and the final `PreparedRequest`. Each API module reads its own body into these
few inputs; the rules (and their error messages) are the reference's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from services.recipe.conversation import Conversation, Message, ReasoningEffort, ResponseFormat, Role, ToolChoice
from services.recipe.convert import schema as schemas
from services.recipe.convert import strict
from services.recipe.convert.options import ConvertOptions, Encoding
from services.recipe.errors import ConversionError, FieldRefusal, SchemaError, StrictError
from services.recipe.formats.jsontext import dumps
from services.recipe.prepared import (
    Api,
    InferenceSpec,
    OutputConstraint,
    ParsingSpec,
    PreparedRequest,
    ThinkingStage,
    ToolSpec,
)

# API effort spellings -> the format's efforts ("none" turns thinking off instead).
EFFORTS: dict[str, ReasoningEffort] = {
    "minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "xhigh", "ultra": "max", "max": "max",
}
SEED_LIMIT = 1 << 63
MAX_CHOICES = 16  # n, best_of: each choice is one more generation of the whole answer


@dataclass
class Sampling:
    """Sampling as the client asked (f32 values already rounded); resolved by `inference`."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    reasoning_budget: int | None = None  # thinking.budget_tokens; kept only in thinking mode
    n: int = 1  # choices (recipe/fanout.py)


def thinking_mode(requested: bool | None, effort: str | None, options: ConvertOptions, encoding: Encoding) -> bool:
    """An explicit thinking switch wins; else effort "none" turns thinking off; else the deployment default."""
    if requested is not None:
        return requested
    if effort == "none":
        return False
    return options.default_thinking and encoding != "chat_template"


def effort_for(thinking: bool, effort: str | None) -> ReasoningEffort | None:
    """The conversation's effort: "high" by default in thinking mode, none without thinking."""
    if not thinking:
        return None
    return EFFORTS.get(effort or "high", "high")


def check_range(name: str, value: float | None, lo: float, hi: float, shown: str) -> None:
    if value is not None and (math.isnan(value) or not lo <= value <= hi):
        raise ConversionError(f"Invalid {name} value, the valid range of {name} is {shown}")


def check_top_p(value: float | None) -> None:
    if value is not None and (math.isnan(value) or not 0.0 < value <= 1.0):
        raise ConversionError("Invalid top_p value, the valid range of top_p is (0, 1.0]")


def check_max_tokens(value: int | None, bound: int) -> None:
    if value is not None and not 1 <= value <= bound:
        raise ConversionError(f"Invalid max_tokens value, the valid range of max_tokens is [1, {bound}]")


def check_choices(name: str, value: int | None) -> None:
    """n and best_of: how many choices one request may generate (each is a whole generation)."""
    if value is not None and not 1 <= value <= MAX_CHOICES:
        raise FieldRefusal(f"Invalid {name} value, the valid range of {name} is [1, {MAX_CHOICES}]", name)


def check_seed(value: int | None) -> None:
    if value is not None and value >= SEED_LIMIT:
        raise ConversionError("Invalid seed value, the valid range of seed is [0, 2^63)")


def resolve_top_p(encoding: Encoding, thinking: bool, requested: float | None, offers_tools: bool) -> float:
    """The sampling top_p each model version is served with (f32 values, as the reference computes them)."""
    if encoding == "v4":
        if thinking:
            return _F32_095 if offers_tools else 1.0
        return 1.0 if requested is None else requested
    if encoding == "v41":
        if not thinking or requested is None:
            return 1.0
        return max(requested, _F32_095)
    return 1.0 if requested is None else requested


_F32_095 = 0.949999988079071  # 0.95 as an f32


# --- tools ---------------------------------------------------------------------------------------------------


def tool_spec(
    name: str, description: str | None, parameters: Any, is_strict: bool | None, *, where: str,
    defer_loading: bool = False, required_schema: bool = False,
) -> ToolSpec:
    """A client tool, its parameter schema checked (and normalized when strict). `where` names the name field
    in error messages ("tools[0].function.name"); with `required_schema` a missing schema is checked as null
    (Anthropic's input_schema), else it means "no parameters"."""
    check_tool_name(name, where)
    missing = parameters is None and not required_schema
    if missing:
        parameters = {}
    elif not is_strict:  # a strict schema is checked by its own, stricter reading
        try:
            schemas.check(parameters)
        except SchemaError as exc:
            raise ConversionError(f"Invalid schema for function '{name}': {exc}") from None
        problem = schemas.object_type_error(parameters)
        if problem is not None:
            raise ConversionError(f"Invalid schema for function '{name}': {problem}")
    if is_strict:  # no schema at all is read as an empty object schema
        parameters = strict_schema({"type": "object"} if missing else parameters, tool=True)
    return ToolSpec(name, description, parameters, is_strict, defer_loading)


def check_tool_name(name: str, where: str) -> None:
    if not name:
        raise ConversionError(
            f"Invalid '{where}': empty string. Expected a string with minimum length 1, but got an empty string "
            "instead."
        )
    if len(name) > 128:
        raise ConversionError(
            f"Invalid '{where}': string too long. Expected a string with maximum length 128, but got a string "
            f"with length {len(name)} instead."
        )
    if not all(c.isascii() and (c.isalnum() or c in "_-") for c in name):
        raise ConversionError(
            f"Invalid '{where}': string does not match pattern. Expected a string that matches the pattern "
            "'^[a-zA-Z0-9_-]+$'."
        )


def strict_schema(value: Any, *, tool: bool) -> dict[str, Any]:
    try:
        normalized, is_object = strict.normalize(value, empty_top=tool)
    except StrictError as exc:
        if not exc.shape:
            raise ConversionError(exc.message) from None
        prefix = "Invalid tool parameters schema : " if tool else "Invalid json schema: "
        raise ConversionError(prefix + exc.message) from None
    if not is_object:
        what = "function parameters schema" if tool else "json schema"
        raise ConversionError(f"The top level of the {what} must be an object.")
    return normalized


def check_strict_mix(tools: list[ToolSpec]) -> None:
    stricts = {bool(t.strict) for t in tools}
    if len(stricts) > 1:
        raise ConversionError("Cannot use strict tool with non-strict tool in the same request")


def response_schema(value: Any, is_strict: bool | None) -> tuple[Any, str]:
    """A json_schema response format: (schema for the prompt, compact schema for constrained decoding)."""
    if is_strict:
        return value, dumps(strict_schema(value, tool=False), "compact")
    try:
        schemas.check(value)
    except SchemaError as exc:
        raise ConversionError(f"Invalid json schema: {exc}") from None
    constraint = value
    return value, dumps(constraint, "compact")


def developer_role(encoding: str) -> Role:
    """OpenAI reads a developer message as a system one; V4 has no system turns mid-conversation, so there it is
    a user message (as the reference does for Responses input)."""
    return "user" if encoding == "v4" else "system"


def refuse_media(where: str | None, model: str) -> None:
    """Deviation: the reference shows V4 an image or file as "[Unsupported Image]" (and resolves V4.1 images);
    we serve text-only models, so `where` (the first image or file part, None = none) is refused, after every
    other check (so any other problem is reported as the reference reports it)."""
    if where is not None:
        raise FieldRefusal(f"{where}: image and file input is not supported: model {model} reads text only", None)


def mentions_json(messages: list[Message]) -> bool:
    """json_object needs the word in some message (any role, any case), as OpenAI requires."""
    return any("json" in m.content.lower() for m in messages)


# --- the result ------------------------------------------------------------------------------------------------


def output_constraint(conv: Conversation, schema_text: str | None) -> OutputConstraint | None:
    if conv.offers_tools:
        listed = [_tool_json(t) for t in conv.tools]
        required = conv.tool_choice == "required"
        return OutputConstraint("tool_call_required" if required else "tool_call", dumps(listed, "compact"))
    fmt = conv.response_format
    if fmt.kind == "json_object":
        return OutputConstraint("json", "")
    if fmt.kind == "json_schema":
        return OutputConstraint("json", schema_text or dumps(fmt.schema, "compact"))
    if fmt.kind == "regex":
        return OutputConstraint("regex", fmt.regex or "")
    return None


def _tool_json(tool: ToolSpec) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "description": tool.description, "parameters": tool.parameters,
                                "strict": tool.strict}
    if tool.defer_loading:
        function["defer_loading"] = True
    return {"type": "function", "function": function}


def parsing(conv: Conversation, stop: list[str]) -> ParsingSpec:
    stage: ThinkingStage | None = None
    if conv.thinking:
        stage = "reasoning_start"
        if conv.continues_prefix:
            last = conv.messages[-1]
            if last.content or last.tool_calls:
                stage = "content_continuation"
            elif last.reasoning_content:
                stage = "reasoning_continuation"
    return ParsingSpec(
        parse_tool_calls=conv.offers_tools,
        starts_in_tool_calls=conv.offers_tools and conv.tool_choice == "required",
        parse_json_output=conv.response_format.kind == "json_object",
        thinking_initial_stage=stage,
        stop_sequences=list(stop),
    )


def prepared(
    api: Api, model: str, encoding: Encoding, conv: Conversation, sampling: Sampling, *, stream: bool,
    include_usage: bool = False, schema_text: str | None = None, echo: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> PreparedRequest:
    inference = InferenceSpec(
        max_tokens=sampling.max_tokens,
        temperature=1.0 if conv.thinking or sampling.temperature is None else sampling.temperature,
        top_p=resolve_top_p(encoding, conv.thinking, sampling.top_p, conv.offers_tools),
        seed=sampling.seed,
        logprobs=sampling.logprobs,
        top_logprobs=sampling.top_logprobs,
        output_constraint=output_constraint(conv, schema_text),
        reasoning_budget=sampling.reasoning_budget if conv.thinking else None,
        n=sampling.n, best_of=sampling.n,
    )
    return PreparedRequest(
        api=api, model=model, encoding=encoding, stream=stream, include_usage=include_usage, conversation=conv,
        inference=inference, parsing=parsing(conv, sampling.stop), echo=echo or {}, extra=extra or {},
    )


def conversation(
    messages: list[Message], tools: list[ToolSpec], choice: ToolChoice, thinking: bool, effort: str | None,
    response_format: ResponseFormat,
) -> Conversation:
    return Conversation(
        tuple(messages), tuple(tools), choice, thinking, effort_for(thinking, effort), response_format
    )
