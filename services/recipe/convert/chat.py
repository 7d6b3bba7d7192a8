"""OpenAI Chat Completions -> PreparedRequest, with the reference's validation (deepseek-recipe 0.2.0).

Beyond OpenAI's fields: `thinking` ({"type": "enabled" | "disabled"}), `reasoning_content` on assistant
messages, the `latest_reminder` role, and DeepSeek's prefix continuation: a final assistant message with
`"prefix": true` is continued by the model instead of answered. Beyond the reference: the `developer` role
(system instructions, `common.developer_role`); image and file parts are refused (we serve text-only models);
vLLM's fields and the ones we refuse are read afterwards by `convert/fields.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.recipe import conversation as cv
from services.recipe.conversation import Message, ResponseFormat
from services.recipe.convert import common, images, structured
from services.recipe.convert.options import ConvertOptions, Encoding
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
    json_field,
)
from services.recipe.errors import BodyError, ConversionError
from services.recipe.prepared import PreparedRequest, ToolSpec

MAX_STOPS = 16
UNSUPPORTED_IMAGE = "[Unsupported Image]"


def _content(value: Any) -> list[tuple[str, Any]] | str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [_PART.read(v) for v in value]
    raise BodyError("content should be a string or a list")


def _stop(value: Any) -> list[str] | str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [Str.read(v) for v in value]
    raise BodyError("expected a string or a list")


_CHOICE_ERROR = "expected one of `none`, `auto`, `required` or a tool"
_CHOICE_FUNCTION = Struct("ChatCompletionToolChoiceFunction", [Field("name", Str, required=True)])


def _tool_choice(value: Any) -> str | tuple[str, str]:
    """"none" | "auto" | "required" | ("function", name)."""
    if isinstance(value, str) and value in ("none", "auto", "required"):
        return value
    if not isinstance(value, dict) or "type" not in value:
        raise BodyError(_CHOICE_ERROR)
    try:
        Enum(["function"]).read(value["type"])
    except BodyError as exc:
        raise BodyError(f"field `type`: {exc.message}") from None
    try:
        function = _CHOICE_FUNCTION.read(value.get("function"))
    except BodyError as exc:
        raise BodyError(f"field `function`: {exc.message}") from None
    return ("function", function["name"])


_PART = Tagged("ChatCompletionRequestContentBlock", "type", {
    "text": Struct("Text", [Field("text", Str, required=True)], kind="struct variant"),
    "image_url": Struct("ImageUrl", [Field("image_url", Struct("ChatCompletionImageUrl", [
        Field("url", Str, required=True), Field("detail", Opt(Enum(["low", "high", "original", "auto"]))),
    ]), required=True)], kind="struct variant"),
    "file": Struct("File", [Field("file", Any_)], kind="struct variant"),
})
_CONTENT = Custom(_content)
_TOOL_CALL = Struct("ChatCompletionRequestToolCall", [
    Field("id", Str, required=True), Field("type", Enum(["function"]), required=True),
    Field("function", Struct("ChatCompletionRequestFunctionCall", [
        Field("name", Str, required=True), Field("arguments", Str, required=True),
    ]), required=True),
])
_MESSAGE = Tagged("ChatCompletionRequestMessage", "role", {
    "system": Struct("System", [Field("content", _CONTENT, required=True), Field("name", Opt(Str))]),
    "user": Struct("User", [Field("content", _CONTENT, required=True), Field("name", Opt(Str))]),
    "assistant": Struct("Assistant", [
        Field("content", Opt(_CONTENT)), Field("reasoning_content", Opt(Str)),
        Field("tool_calls", Opt(Seq(_TOOL_CALL))), Field("prefix", Opt(Bool)), Field("name", Opt(Str)),
    ]),
    "tool": Struct("Tool", [Field("content", _CONTENT, required=True), Field("tool_call_id", Str, required=True)]),
    "latest_reminder": Struct("LatestReminder", [Field("content", Str, required=True)]),
    # OpenAI's newer name for system instructions; the reference refuses it (a deviation: see _messages).
    "developer": Struct("Developer", [Field("content", _CONTENT, required=True), Field("name", Opt(Str))]),
}, unlisted=("developer",))
_TOOL = Struct("ChatCompletionTool", [
    Field("type", Enum(["function"]), required=True),
    Field("function", Struct("ChatCompletionFunctionDefinition", [
        Field("name", Str, required=True), Field("description", Opt(Str)), Field("parameters", Any_),
        Field("strict", Opt(Bool)),
    ]), required=True),
])
_RESPONSE_FORMAT = Tagged("ChatCompletionResponseFormat", "type", {
    "json_object": None,
    "json_schema": Struct("JsonSchema", [Field("json_schema", Struct("ChatCompletionResponseFormatJsonSchema", [
        Field("name", Opt(Str)), Field("schema", Any_, required=True), Field("strict", Opt(Bool)),
    ]), required=True)]),
    "regex": Struct("Regex", [Field("regex", Str, required=True)]),
    "text": None,
})
Part = tuple[str, dict[str, Any]]  # a tagged variant as serde reads it: (tag, its fields)
_EFFORTS = ["none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"]


@dataclass(frozen=True)
class ChatCompletionStreamOptions:
    include_usage: bool | None = json_field(Opt(Bool))


@dataclass(frozen=True)
class ChatCompletionThinking:
    type: str = json_field(Enum(["adaptive", "enabled", "disabled"]), required=True)
    budget_tokens: int | None = json_field(Opt(UInt(64)))


@dataclass(frozen=True)
class ChatCompletionRequest:
    messages: list[Part] = json_field(Seq(_MESSAGE), required=True)
    model: str = json_field(Str, required=True)
    frequency_penalty: float | None = json_field(Opt(F32))
    presence_penalty: float | None = json_field(Opt(F32))
    logprobs: bool | None = json_field(Opt(Bool))
    top_logprobs: int | None = json_field(Opt(UInt(8)))
    max_tokens: int | None = json_field(Opt(UInt(32)))
    n: int | None = json_field(Opt(UInt(8)))
    seed: int | None = json_field(Opt(UInt(64)))
    stop: list[str] | str | None = json_field(Opt(Custom(_stop)))
    stream: bool | None = json_field(Opt(Bool))
    stream_options: ChatCompletionStreamOptions | None = json_field(Opt(Record(ChatCompletionStreamOptions)))
    temperature: float | None = json_field(Opt(F32))
    top_p: float | None = json_field(Opt(F32))
    response_format: Part | None = json_field(Opt(_RESPONSE_FORMAT))
    tools: list[dict[str, Any]] | None = json_field(Opt(Seq(_TOOL)))
    tool_choice: str | tuple[str, str] | None = json_field(Opt(Custom(_tool_choice)))
    parallel_tool_calls: bool | None = json_field(Opt(Bool))
    thinking: ChatCompletionThinking | None = json_field(Opt(Record(ChatCompletionThinking)))
    reasoning_effort: str | None = json_field(Opt(Enum(_EFFORTS)))


REQUEST = Record(ChatCompletionRequest)


def convert(body: Any, options: ConvertOptions) -> PreparedRequest:
    """Validation runs in the reference's order, so a request with several problems gets the same error."""
    req = REQUEST.read(body)
    encoding = options.encoding(req.model)
    raw_tools = req.tools or []
    for i, t in enumerate(raw_tools):
        common.check_tool_name(t["function"]["name"], f"tools[{i}].function.name")
    if not req.messages:
        raise ConversionError("Empty input messages")
    thinking_type = req.thinking.type if req.thinking else None
    thinking = common.thinking_mode(
        None if thinking_type is None else thinking_type != "disabled", req.reasoning_effort, options, encoding
    )
    messages = _messages(req.messages, thinking, encoding, options)
    if req.response_format is not None and req.response_format[0] == "json_object":
        if not common.mentions_json(messages):
            raise ConversionError(
                "Prompt must contain the word 'json' in some form to use 'response_format' of type 'json_object'."
            )
    tools, choice = _tools(raw_tools, req.tool_choice, thinking)
    if req.messages[-1][0] == "assistant" and req.messages[-1][1]["prefix"]:
        if req.response_format is not None and req.response_format[0] == "json_object":
            raise ConversionError("response_format json_object should not be used with prefix")
        if raw_tools or any(m.tool_calls for m in messages):
            raise ConversionError("Function call should not be used with prefix")
    stop = _stops(req.stop)
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise ConversionError("stream_options should be set along with stream = true")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    fmt, schema_text = _response_format(req.response_format)
    if req.response_format is not None and any(t.strict for t in tools):
        raise ConversionError("response_format should not be used with tools")
    sampling = _sampling(req, stop, thinking, options)
    sampling.reasoning_budget = req.thinking.budget_tokens if req.thinking else None
    if encoding != "v41":
        common.refuse_media(_first_media(req.messages), req.model)
    messages = [m for m in messages if m.role != "system" or m.content]  # empty system messages say nothing
    conv = common.conversation(messages, tools, choice, thinking, req.reasoning_effort, fmt)
    prepared = common.prepared(
        "chat", req.model, encoding, conv, sampling, stream=stream, include_usage=include_usage,
        schema_text=schema_text,
    )
    return structured.one_call(prepared, req.parallel_tool_calls)


def _first_media(messages: list[tuple[str, dict[str, Any]]]) -> str | None:
    """Where the first image or file part is ("messages[1].content[0] (image_url)"), None if there is none."""
    for i, (_, m) in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            for j, (kind, _) in enumerate(content):
                if kind != "text":
                    return f"messages[{i}].content[{j}] ({kind})"
    return None


def _stops(value: list[str] | str | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        if not value:
            raise ConversionError(
                "Invalid 'stop': empty string. Expected a string with minimum length 1, but got an empty string "
                "instead."
            )
        return [value]
    if len(value) > MAX_STOPS:
        raise ConversionError(f"Stop string array too long: {len(value)}")
    for i, s in enumerate(value):
        if not s:
            raise ConversionError(
                f"Invalid 'stop[{i}]': empty string. Expected a string with minimum length 1, but got an empty "
                "string instead."
            )
    return value


def _sampling(req: ChatCompletionRequest, stop: list[str], thinking: bool, options: ConvertOptions) -> common.Sampling:
    common.check_choices("n", req.n)  # (the reference serves n = 1 only: a deviation, tests/oracle/conftest.py)
    for name in ("presence_penalty", "frequency_penalty"):
        common.check_range(name, getattr(req, name), -2.0, 2.0, "[-2, 2]")
    common.check_range("temperature", req.temperature, 0.0, 2.0, "[0, 2]")
    common.check_top_p(req.top_p)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise ConversionError(
                "Invalid top_logprobs and logprobs value, logprobs must be set to true if top_logprobs is used."
            )
        if req.top_logprobs > 20:
            raise ConversionError("Invalid top_logprobs value, the valid range of top_logprobs is [0, 20].")
    common.check_max_tokens(req.max_tokens, options.max_tokens_bound(thinking))
    common.check_seed(req.seed)
    return common.Sampling(
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
        logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs, stop=stop, n=req.n or 1,
    )


def _text(content: list[tuple[str, Any]] | str | None, encoding: Encoding, i: int) -> tuple[str, cv.Images]:
    """Parts joined by blank lines; an image is "[Unsupported Image]" for V4, a placeholder and a source for V4.1."""
    if content is None or isinstance(content, str):
        return content or "", cv.NO_IMAGES
    if encoding != "v41":
        text = "\n\n".join(part["text"] if kind == "text" else UNSUPPORTED_IMAGE for kind, part in content)
        return text, cv.NO_IMAGES
    pieces: list[images.Piece] = []
    for j, (kind, part) in enumerate(content):
        if kind == "text":
            pieces.append(part["text"])
        elif kind == "file":  # the reference's V4.1 reads no file part
            raise ConversionError(f".messages[{i}]: file must have a file_id or file_data")
        else:
            url = part["image_url"]
            pieces.append(images.image_url(url["url"], url["detail"], f".messages[{i}]",
                                           f".messages[{i}].image_url.url[{j}]: image_url.url"))
    return images.join(pieces)


def _assistant_text(content: list[tuple[str, Any]] | str | None, encoding: Encoding, i: int) -> str:
    if encoding == "v41" and isinstance(content, list):
        for kind, _ in content:
            if kind == "file":
                raise ConversionError(f".messages[{i}]: file must have a file_id or file_data")
            if kind == "image_url":
                raise ConversionError("Image in assistant message is not supported")
    return _text(content, "v4" if encoding == "v41" else encoding, i)[0]


def _messages(
    raw: list[tuple[str, dict[str, Any]]], thinking: bool, encoding: Encoding, options: ConvertOptions
) -> list[Message]:
    """Messages are checked in order (each one's own rules, then whether tool results answer the calls before
    them); a prefix flag on any message but the last is refused only after that pass."""
    out: list[Message] = []
    pending: list[str] | None = None
    answered: set[str] = set()
    for i, (role, m) in enumerate(raw):
        if role != "tool" and pending:
            raise _insufficient()
        if role == "assistant":
            msg = _assistant(i, m, thinking, encoding, options)
        elif role == "tool":
            text, shown = _text(m["content"], encoding, i)
            msg = cv.tool(text, m["tool_call_id"], shown)
        else:
            text, shown = _text(m["content"], encoding, i)
            kind = common.developer_role(encoding) if role == "developer" else role
            msg = Message(kind, text, images=shown[0], image_at=shown[1])  # type: ignore[arg-type]
        pending = _answer(pending, msg, i, answered)
        out.append(msg)
    if pending:
        raise _insufficient()
    if any(m.prefix for m in out[:-1]):
        raise ConversionError(
            "Invalid completion message: prefix set true with message which is not final message or message role "
            "is not assistant"
        )
    return out


def _assistant(i: int, m: dict[str, Any], thinking: bool, encoding: Encoding, options: ConvertOptions) -> Message:
    if m["content"] is None and m["tool_calls"] is None:
        raise ConversionError("Invalid assistant message: content or tool_calls must be set")
    calls = None
    if m["tool_calls"] is not None:
        if not m["tool_calls"]:
            raise ConversionError(
                f"Invalid 'messages[{i}].tool_calls': empty array. Expected an array with minimum length 1, but got "
                "an empty array instead."
            )
        calls = tuple(cv.ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
        ids = [c.id for c in calls]
        for call_id in ids:
            if ids.count(call_id) > 1:
                raise ConversionError(f"Duplicate value for 'tool_call_id' of {call_id} in message[{i}]")
    reasoning = m["reasoning_content"] if thinking else None
    if thinking and reasoning is None:
        if not options.fill_missing_reasoning:
            raise ConversionError("The `reasoning_content` in the thinking mode must be passed back to the API.")
        reasoning = ""
    return cv.assistant(_assistant_text(m["content"], encoding, i), reasoning, calls, prefix=bool(m["prefix"]))


def _answer(pending: list[str] | None, msg: Message, i: int, answered: set[str]) -> list[str] | None:
    """Tool results must answer the calls of the tool-calling message right before them, one result per call,
    before any other message. Returns the calls still unanswered; `answered` collects this group's answers."""
    if msg.role == "tool":
        if msg.tool_call_id in answered:
            raise ConversionError(f"Duplicate value for 'tool_call_id' of {msg.tool_call_id} in message[{i}]")
        if not pending:
            raise ConversionError(
                "Messages with role 'tool' must be a response to a preceding message with 'tool_calls'"
            )
        if msg.tool_call_id not in pending:
            raise ConversionError(
                "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                f"'tool_call_id', The following tool_call_ids did not have response messages: {msg.tool_call_id}"
            )
        pending.remove(msg.tool_call_id or "")
        answered.add(msg.tool_call_id or "")
        return pending
    if pending:
        raise _insufficient()
    answered.clear()
    return [c.id for c in msg.tool_calls] if msg.tool_calls else None


def _insufficient() -> ConversionError:
    return ConversionError(
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        "'tool_call_id'. (insufficient tool messages following tool_calls message)"
    )


def _tools(
    raw: list[dict[str, Any]], choice: str | tuple[str, str] | None, thinking: bool
) -> tuple[list[ToolSpec], cv.ToolChoice]:
    choice = choice or "auto"
    if choice == "none":  # the tools are not offered, so not even checked
        return [], "none"
    tools: list[ToolSpec] = []
    for i, t in enumerate(raw):
        fn = t["function"]
        if any(fn["name"] == seen.name for seen in tools):
            raise ConversionError("Tool names must be unique.")
        tools.append(common.tool_spec(
            fn["name"], fn["description"], fn["parameters"], fn["strict"], where=f"tools[{i}].function.name"
        ))
    if not tools:
        return [], "auto"
    if isinstance(choice, tuple):
        named = [t for t in tools if t.name == choice[1]]
        if not named:
            raise ConversionError(
                f"Invalid value for 'tool_call': no function named '{choice[1]}' was specified in the 'tools' "
                "parameter."
            )
        tools, choice = named, "required"
    if choice != "auto" and thinking:
        raise ConversionError("Thinking mode does not support this tool_choice")
    common.check_strict_mix(tools)
    return tools, choice  # type: ignore[return-value]


def _response_format(value: tuple[str, dict[str, Any]] | None) -> tuple[ResponseFormat, str | None]:
    if value is None or value[0] == "text":
        return cv.TEXT, None
    kind, body = value
    if kind == "json_object":
        return ResponseFormat("json_object"), None
    if kind == "regex":
        return ResponseFormat("regex", regex=body["regex"]), None
    spec = body["json_schema"]
    schema, text = common.response_schema(spec["schema"], spec["strict"])
    return ResponseFormat("json_schema", schema=schema), text
