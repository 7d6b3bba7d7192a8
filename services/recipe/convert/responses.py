"""OpenAI Responses -> PreparedRequest, with the reference's validation (deepseek-recipe 0.2.0).

Input items become messages: `instructions` a leading system message, developer messages system ones (user
ones on V4), and
the assistant side of a turn (reasoning items, assistant messages, function calls) one assistant message whose
calls must be answered by function_call_output items right after it. Tools may be functions, namespaces of
functions (flattened to `namespace__name`; the map back is in `extra["namespace_tool_map"]`), the built-in
`apply_patch` custom tool, or web search (dropped, as the reference does by default). Item and tool types the
reference does not know are ignored, like it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from services.recipe import conversation as cv
from services.recipe.conversation import ResponseFormat
from services.recipe.convert import apply_patch, common, structured
from services.recipe.convert.options import ConvertOptions
from services.recipe.convert.responses_input import input_messages, namespaced, read_input
from services.recipe.convert.serde import (
    F32,
    Any_,
    Bool,
    Custom,
    Enum,
    Field,
    Opt,
    Record,
    Seq,
    Str,
    Struct,
    Tagged,
    UInt,
    f32_display,
    invalid_type,
    json_field,
    unexpected,
)
from services.recipe.errors import BodyError, ConversionError, FieldRefusal
from services.recipe.prepared import PreparedRequest, ToolSpec

_FUNCTION_FIELDS = [
    Field("name", Str, required=True), Field("description", Opt(Str)), Field("parameters", Any_),
    Field("strict", Opt(Bool)), Field("defer_loading", Opt(Bool)),
]
_NAMESPACED = Tagged("ResponsesNamespaceTool", "type", {
    "function": Struct("ResponsesFunctionTool", _FUNCTION_FIELDS),
    "custom": Struct("Custom", [Field("name", Str, required=True), Field("description", Opt(Str))]),
}, int_tags=True)
_KNOWN_TOOLS: dict[str, Struct] = {
    "function": Struct("ResponsesFunctionTool", _FUNCTION_FIELDS),
    "custom": Struct("Custom", [Field("name", Str, required=True), Field("description", Opt(Str)),
                                Field("format", Any_)]),
    "namespace": Struct("Namespace", [
        Field("name", Str, required=True), Field("description", Opt(Str)),
        Field("tools", Seq(_NAMESPACED), required=True),
    ]),
}


def _tool(value: Any) -> tuple[str, dict[str, Any]]:
    """A tool declaration, tagged by "type"; unknown types are kept as bare kinds (and ignored)."""
    rest: Any
    if isinstance(value, list):  # serde's sequence form of a tagged enum: the tag first
        if not value:
            raise BodyError("missing field `type`")
        kind, rest = value[0], value[1:]
    elif isinstance(value, dict):
        if "type" not in value:
            raise BodyError("missing field `type`")
        kind, rest = value["type"], value
    else:
        raise invalid_type(value, "internally tagged enum ResponsesTool")
    if not isinstance(kind, str):
        raise invalid_type(kind, "variant identifier")
    struct = _KNOWN_TOOLS.get(kind)
    return kind, ({} if struct is None else struct.read(rest))


_CHOICE_ERROR = "expected one of `none`, `auto`, `required` or a tool choice object"
_CHOICE = Tagged("ResponsesNamedToolChoice", "type", {
    "function": Struct("Function", [Field("name", Str, required=True)]),
    "custom": Struct("Custom", [Field("name", Str, required=True)]),
    "web_search": None, "web_search_2025_08_26": None,
})


def _tool_choice(value: Any) -> Any:
    if isinstance(value, str) and value in ("none", "auto", "required"):
        return value
    if not isinstance(value, dict) or "type" not in value:
        raise BodyError(_CHOICE_ERROR)
    return _CHOICE.read(value)


@dataclass(frozen=True)
class ResponsesReasoningConfig:
    effort: str | None = json_field(Opt(Enum(["none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"])))
    summary: str | None = json_field(Opt(Enum(["auto", "concise", "detailed"])))
    generate_summary: Any = json_field(Any_)


@dataclass(frozen=True)
class ResponsesTextConfig:
    format: tuple[str, dict[str, Any]] | None = json_field(Tagged("ResponsesTextFormat", "type", {
        "text": None,
        "json_schema": Struct("JsonSchema", [
            Field("name", Str, required=True), Field("schema", Any_, required=True),
            Field("strict", Opt(Bool)), Field("description", Any_),
        ]),
        "json_object": None,
    }), seq_default=True)
    verbosity: Any = json_field(Any_)


@dataclass(frozen=True)
class ResponsesRequest:
    model: str = json_field(Str, required=True)
    input: str | list[Any] | None = json_field(Opt(Custom(read_input)))
    instructions: str | None = json_field(Opt(Str))
    max_output_tokens: int | None = json_field(Opt(UInt(32)))
    temperature: float | None = json_field(Opt(F32))
    top_p: float | None = json_field(Opt(F32))
    top_logprobs: int | None = json_field(Opt(UInt(8)))
    tools: list[tuple[str, dict[str, Any]]] | None = json_field(Opt(Seq(Custom(_tool))))
    tool_choice: Any = json_field(Opt(Custom(_tool_choice)))
    reasoning: ResponsesReasoningConfig | None = json_field(Opt(Record(ResponsesReasoningConfig)))
    text: ResponsesTextConfig | None = json_field(Opt(Record(ResponsesTextConfig)))
    stream: bool | None = json_field(Opt(Bool))
    user: str | None = json_field(Opt(Str))


REQUEST = Record(ResponsesRequest)


@cache
def apply_patch_tool(encoding: str) -> ToolSpec:
    """The one custom tool the reference supports, offered to the model as a function taking the patch."""
    return ToolSpec("apply_patch", apply_patch.description(encoding), apply_patch.PARAMETERS)


def convert(body: Any, options: ConvertOptions) -> PreparedRequest:
    """Validation runs in the reference's order, so a request with several problems gets the same error."""
    req = REQUEST.read(body)
    encoding = options.encoding(req.model)
    _declarations(req.tools or [])
    effort = req.reasoning.effort if req.reasoning else None
    thinking = common.thinking_mode(None, effort, options, encoding)
    messages = input_messages(req.input, req.instructions, thinking, options, encoding)
    tools, choice, namespaces = _tools(req, thinking, options, encoding)
    fmt_value = req.text.format if req.text else None
    if fmt_value is not None and fmt_value[0] == "json_object" and not common.mentions_json(messages):
        raise ConversionError(
            "Response input messages must contain the word 'json' in some form to use 'text.format' of type "
            "'json_object'."
        )
    fmt, schema_text = _text_format(fmt_value)
    common.check_strict_mix(tools)
    if fmt_value is not None and fmt_value[0] != "text" and any(t.strict for t in tools):
        raise ConversionError("response_format should not be used with tools")
    sampling = _sampling(req, thinking, options)
    if encoding != "v41":
        common.refuse_media(_first_media(req.input), req.model)
    parallel = _parallel_tool_calls(body)
    conv = common.conversation(messages, tools, choice, thinking, effort, fmt)
    echo = {
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": 1.0 if req.temperature is None else f32_display(req.temperature),
        "top_p": 1.0 if req.top_p is None else f32_display(req.top_p),
        "top_logprobs": req.top_logprobs or 0,
        "user": req.user, "reasoning": _raw(body, "reasoning"), "text": _raw(body, "text"),
        "tool_choice": _raw(body, "tool_choice"), "tools": _raw(body, "tools"),
        "parallel_tool_calls": parallel is not False,
    }
    prepared = common.prepared(
        "responses", req.model, encoding, conv, sampling, stream=bool(req.stream), schema_text=schema_text,
        echo=echo, extra={"namespace_tool_map": namespaces} if namespaces else None,
    )
    return structured.one_call(prepared, parallel)


def _declarations(tools: list[tuple[str, dict[str, Any]]]) -> None:
    """The first look at the tools, before anything else is converted: names, custom tools, namespaces."""
    for i, (kind, t) in enumerate(tools):
        if kind == "function":
            common.check_tool_name(t["name"], f"tools[{i}].name")
        elif kind == "custom" and t["name"] != "apply_patch":
            raise ConversionError(f"Unsupported custom tool: '{t['name']}'. Only 'apply_patch' is supported.")
        elif kind == "namespace":
            seen: set[str] = set()
            for j, (inner_kind, it) in enumerate(t["tools"]):
                if inner_kind == "custom":
                    raise ConversionError(
                        "Currently custom tools are not allowed inside a namespace. Found custom tool "
                        f"'{it['name']}' in tools[{i}].tools[{j}]."
                    )
                if it["name"] in seen:
                    raise ConversionError("Tool names within a namespace must be unique.")
                seen.add(it["name"])
                common.check_tool_name(it["name"], f"tools[{i}].tools[{j}].name")


def _first_media(items: Any) -> str | None:
    """Where the first image or file part is ("input[1].content[0] (input_image)"), None if there is none."""
    if not isinstance(items, list):
        return None
    for i, item in enumerate(items):
        if item is None:
            continue
        kind, f = item
        key = "content" if kind == "message" else "output"
        parts = f.get(key)
        if isinstance(parts, list):
            for j, (part, _) in enumerate(parts):
                if part in ("input_image", "input_file"):
                    return f"input[{i}].{key}[{j}] ({part})"
    return None


def _parallel_tool_calls(body: Any) -> bool | None:
    """Not the reference's (it reads no such field): false allows one call under the tool grammar, as Chat's does
    (structured.one_call); a value that is not a boolean is refused by name, after the reference's checks."""
    value = _raw(body, "parallel_tool_calls")
    if value is not None and not isinstance(value, bool):
        raise FieldRefusal(f"Invalid parallel_tool_calls value: expected a boolean, got {unexpected(value)}",
                           "parallel_tool_calls")
    return value


def _raw(body: Any, key: str) -> Any:
    return body.get(key) if isinstance(body, dict) else None


def _sampling(req: ResponsesRequest, thinking: bool, options: ConvertOptions) -> common.Sampling:
    common.check_range("temperature", req.temperature, 0.0, 2.0, "[0, 2]")
    common.check_top_p(req.top_p)
    if req.top_logprobs is not None and req.top_logprobs > 20:
        raise ConversionError("Invalid top_logprobs value, the valid range of top_logprobs is [0, 20].")
    common.check_max_tokens(req.max_output_tokens, options.max_tokens_bound(thinking))
    return common.Sampling(
        max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        top_logprobs=req.top_logprobs, logprobs=req.top_logprobs is not None,
    )


def _tools(
    req: ResponsesRequest, thinking: bool, options: ConvertOptions, encoding: str
) -> tuple[list[ToolSpec], cv.ToolChoice, dict[str, tuple[str, str]]]:
    choice = req.tool_choice or "auto"
    tools: list[ToolSpec] = []
    namespaces: dict[str, tuple[str, str]] = {}
    if choice == "none":  # the tools are not offered, so not even checked
        return [], "none", namespaces
    names: set[str] = set()
    for i, (kind, t) in enumerate(req.tools or []):
        if kind in ("function", "custom"):
            if t["name"] in names:
                raise ConversionError("Tool names must be unique.")
            names.add(t["name"])
        if kind == "function":
            tools.append(_function(t, f"tools[{i}].name"))
        elif kind == "custom":
            tools.append(apply_patch_tool(encoding))
        elif kind == "namespace":
            for j, (_, it) in enumerate(t["tools"]):
                spec = _function(it, f"tools[{i}].tools[{j}].name")
                full = namespaced(t["name"], spec.name, encoding)
                namespaces[full] = (t["name"], spec.name)
                description = spec.description
                if encoding == "v41" and t["description"]:  # V4.1 tells the model what the namespace is for
                    description = f"{t['description']}\n{spec.description or ''}"
                tools.append(ToolSpec(full, description, spec.parameters, spec.strict))
        elif kind.startswith("web_search") and options.responses_web_search == "reject":
            raise ConversionError("Server tools are not supported")
    if not tools:
        return [], "auto", namespaces
    if isinstance(choice, tuple):
        kind, named = choice
        if kind in ("function", "custom"):
            picked = [t for t in tools if t.name == named["name"]]
            if not picked:
                raise ConversionError(
                    f"Invalid value for 'tool_call': no function named '{named['name']}' was specified in the "
                    "'tools' parameter."
                )
            tools, choice = picked, "required"
        else:
            choice = "auto"
    if choice != "auto" and thinking:
        raise ConversionError("Thinking mode does not support this tool_choice")
    return tools, choice, namespaces  # type: ignore[return-value]  # a string choice, validated by its reader


def _function(t: dict[str, Any], where: str) -> ToolSpec:
    return common.tool_spec(t["name"], t["description"], t["parameters"], t["strict"], where=where)


def _text_format(value: tuple[str, dict[str, Any]] | None) -> tuple[ResponseFormat, str | None]:
    if value is None or value[0] == "text":
        return cv.TEXT, None
    if value[0] == "json_object":
        return ResponseFormat("json_object"), None
    spec = value[1]
    schema, text = common.response_schema(spec["schema"], spec["strict"])
    return ResponseFormat("json_schema", schema=schema), text
