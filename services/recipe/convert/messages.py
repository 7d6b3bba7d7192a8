"""Anthropic Messages -> PreparedRequest, with the reference's validation (deepseek-recipe 0.2.0).

Blocks become messages: each user text block is its own user message; tool_result blocks (which must open the
user message after the assistant's tool_use blocks, one per call) become tool messages; an assistant message
becomes one message (thinking blocks -> reasoning, text -> content, tool_use -> calls). A `system`-role message
becomes a user message wrapped in <system-reminder> tags. A final assistant message is answered, not continued
(the reference has no Anthropic prefill). `max_tokens` above the bound is lowered to it, not refused. Beyond
the reference: image and document blocks are refused (we serve text-only models), and `top_k` is honoured
(`convert/fields.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from services.recipe import conversation as cv
from services.recipe.conversation import Message
from services.recipe.convert import common, images, structured
from services.recipe.convert.options import ConvertOptions
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
    invalid_type,
    json_field,
)
from services.recipe.errors import BodyError, ConversionError
from services.recipe.formats.jsontext import dumps
from services.recipe.prepared import PreparedRequest, ToolSpec

_MEDIA = ["image/jpeg", "image/jpg", "image/png", "image/gif", "image/webp"]
_IMAGE_SOURCE = Tagged("MessagesImageSource", "type", {
    "base64": Struct("MessagesImageSource::Base64", [
        Field("media_type", Enum(_MEDIA), required=True), Field("data", Str, required=True),
    ], kind="struct variant"),
    "url": Struct("MessagesImageSource::Url", [Field("url", Str, required=True)], kind="struct variant"),
    "file": Struct("MessagesImageSource::File", [Field("file_id", Str, required=True)], kind="struct variant"),
}, int_tags=True)
_IMAGE = Struct("Image", [Field("source", _IMAGE_SOURCE, required=True)])
_DOCUMENT = Struct("Document", [
    Field("source", Struct("MessagesDocumentSource", [Field("media_type", Opt(Str))]), required=True),
])
_RESULT_PART = Tagged("MessagesToolResultBlock", "type", {
    "text": Struct("Text", [Field("text", Str, required=True)]), "image": _IMAGE, "document": _DOCUMENT,
    "tool_reference": Struct("ToolReference", [Field("tool_name", Str, required=True)]),
})


def _text_or_list(part: Tagged) -> Custom:
    def read(value: Any) -> Any:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return [part.read(v) for v in value]
        raise BodyError("expected a string or a list")

    return Custom(read)


_BLOCK = Tagged("MessagesContentBlock", "type", {
    "text": Struct("Text", [Field("text", Str, required=True)]),
    "image": _IMAGE,
    "document": _DOCUMENT,
    "thinking": Struct("Thinking", [Field("thinking", Str, required=True), Field("signature", Opt(Str))]),
    "server_tool_use": Struct("ServerToolUse", [Field("id", Any_), Field("name", Any_), Field("input", Any_)]),
    "tool_use": Struct("ToolUse", [
        Field("id", Str, required=True), Field("name", Str, required=True), Field("input", Any_, required=True),
    ]),
    "tool_result": Struct("ToolResult", [
        Field("tool_use_id", Str, required=True), Field("content", Opt(_text_or_list(_RESULT_PART))),
        Field("is_error", Opt(Bool)),
    ]),
    "web_search_tool_result": Struct("WebSearchToolResult", [Field("tool_use_id", Any_), Field("content", Any_)]),
    "tool_addition": Struct("ToolAddition", [Field("tool", Struct("MessagesToolReference", [
        Field("type", Any_, required=True), Field("tool_name", Any_),
    ]), required=True)]),
})
_CONTENT = _text_or_list(_BLOCK)


def _message(value: Any) -> tuple[str, Any]:
    """An adjacently tagged message: {"role": ..., "content": ...} (or serde's [role, content])."""
    roles = Enum(["user", "assistant", "system"])
    if isinstance(value, list):  # serde's [role, content] form
        tag = Enum(["user", "assistant", "system"], "variant identifier")
        if len(value) < 2:
            if value:
                tag.read(value[0])
            raise BodyError(f"invalid length {len(value)}, expected adjacently tagged enum MessagesMessage")
        return tag.read(value[0]), _CONTENT.read(value[1])
    if not isinstance(value, dict):
        raise invalid_type(value, "adjacently tagged enum MessagesMessage")
    if "role" not in value:
        raise BodyError("missing field `role`")
    role = roles.read(value["role"])
    if "content" not in value:
        raise BodyError("missing field `content`")
    return role, _CONTENT.read(value["content"])


_CLIENT_TOOL_FIELDS = (
    Field("name", Str, required=True), Field("description", Opt(Str)), Field("input_schema", Any_),
    Field("defer_loading", Opt(Bool)),
)


def _tool(value: Any) -> dict[str, Any] | None:
    """A client tool, or None for a server tool (any tool with a "type"). The reference reads the fields one by
    one and names the field in its errors."""
    if isinstance(value, dict) and "type" in value:
        return None
    fields = value if isinstance(value, dict) else {}
    out: dict[str, Any] = {}
    for field in _CLIENT_TOOL_FIELDS:
        if field.name not in fields:
            if field.required:
                raise BodyError(f"missing field `{field.name}`")
            out[field.name] = None
            continue
        try:
            out[field.name] = field.type.read(fields[field.name])
        except BodyError as exc:
            raise BodyError(f"field `{field.name}`: {exc.message}") from None
    return out
_NO_PARALLEL = Field("disable_parallel_tool_use", Opt(Bool))


@dataclass(frozen=True)
class MessagesThinking:
    type: str = json_field(Enum(["adaptive", "enabled", "disabled"]), required=True)
    budget_tokens: int | None = json_field(Opt(UInt(64)))


@dataclass(frozen=True)
class MessagesMetadata:
    user_id: str | None = json_field(Opt(Str))


@dataclass(frozen=True)
class MessagesOutputConfig:
    effort: str | None = json_field(Opt(Enum(["none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"])))


@dataclass(frozen=True)
class MessagesRequest:
    model: str = json_field(Str, required=True)
    messages: list[tuple[str, Any]] = json_field(Seq(Custom(_message)), required=True)
    max_tokens: int | None = json_field(Opt(UInt(32)))
    system: Any = json_field(Opt(_text_or_list(Tagged("MessagesSystemBlock", "type", {
        "text": Struct("Text", [Field("text", Str, required=True)]),
    }))))
    temperature: float | None = json_field(Opt(F32))
    top_p: float | None = json_field(Opt(F32))
    stop_sequences: list[str] | None = json_field(Opt(Seq(Str)))
    stream: bool | None = json_field(Opt(Bool))
    tools: list[dict[str, Any] | None] | None = json_field(Opt(Seq(Custom(_tool))))
    tool_choice: tuple[str, dict[str, Any]] | None = json_field(Opt(Tagged("MessagesToolChoice", "type", {
        "auto": Struct("Auto", [_NO_PARALLEL]), "any": Struct("Any", [_NO_PARALLEL]),
        "tool": Struct("Tool", [Field("name", Str, required=True), _NO_PARALLEL]), "none": None,
    })))
    thinking: MessagesThinking | None = json_field(Opt(Record(MessagesThinking)))
    metadata: MessagesMetadata | None = json_field(Opt(Record(MessagesMetadata)))
    output_config: MessagesOutputConfig | None = json_field(Opt(Record(MessagesOutputConfig)))


REQUEST = Record(MessagesRequest)


def convert(body: Any, options: ConvertOptions) -> PreparedRequest:
    """Validation runs in the reference's order, so a request with several problems gets the same error."""
    req = REQUEST.read(body)
    encoding = options.encoding(req.model)
    raw_tools = req.tools or []
    for i, t in enumerate(raw_tools):
        if t is None:
            raise ConversionError(f"tools[{i}]: server tools are not supported")
    for i, t in enumerate(raw_tools):
        common.check_tool_name(t["name"], f"tools[{i}].name")  # type: ignore[index]
    thinking_type = req.thinking.type if req.thinking else None
    effort = req.output_config.effort if req.output_config else None
    thinking = common.thinking_mode(
        None if thinking_type is None else thinking_type != "disabled", effort, options, encoding
    )
    if not req.messages:
        raise ConversionError("messages: at least one message is required")
    tool_names = {t["name"] for t in raw_tools if t is not None}
    messages = _messages(req, thinking, options, tool_names, encoding)
    tools, choice = _choice(req.tool_choice, raw_tools, thinking)  # type: ignore[arg-type]
    stop = _stops(req.stop_sequences)
    common.check_range("temperature", req.temperature, 0.0, 2.0, "[0, 2]")
    common.check_top_p(req.top_p)
    max_tokens = req.max_tokens
    if max_tokens is not None:
        bound = options.max_tokens_bound(thinking)
        max_tokens = min(max_tokens, bound)  # too large is lowered to the bound; 0 is refused
        common.check_max_tokens(max_tokens, bound)
    # budget_tokens is read as the reference reads it (any value; Anthropic's own bound, >= 1024 and below
    # max_tokens, is not checked): it closes the reasoning after that many tokens (service.sampling_params)
    sampling = common.Sampling(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, stop=stop,
                               reasoning_budget=req.thinking.budget_tokens if req.thinking else None)
    if encoding != "v41":
        common.refuse_media(_first_media(req.messages), req.model)
    conv = common.conversation(messages, tools, choice, thinking, effort, cv.TEXT)
    prepared = common.prepared("messages", req.model, encoding, conv, sampling, stream=bool(req.stream))
    if req.tool_choice and req.tool_choice[0] == "any":
        prepared = _must_call(prepared)
    settings = req.tool_choice[1] if req.tool_choice else None
    no_parallel = bool(settings and settings.get("disable_parallel_tool_use"))
    return structured.one_call(prepared, False if no_parallel else None)


def _must_call(prepared: PreparedRequest) -> PreparedRequest:
    """"any": the prompt is the reference's "auto" one, but the output must be a call (its grammar opens the block
    itself, structured.py)."""
    oc = prepared.inference.output_constraint
    if oc is None or oc.kind != "tool_call":
        return prepared
    inference = replace(prepared.inference, output_constraint=replace(oc, must_call=True))
    return replace(prepared, inference=inference)


def _first_media(messages: list[tuple[str, Any]]) -> str | None:
    """Where the first image or document block is ("messages.1.content.0 (image)"), None if there is none."""
    for i, (_, content) in enumerate(messages):
        where = _media_in(content, f"messages.{i}.content")
        if where is not None:
            return where
    return None


def _media_in(content: Any, path: str) -> str | None:
    if not isinstance(content, list):
        return None
    for j, (kind, b) in enumerate(content):
        if kind in ("image", "document"):
            return f"{path}.{j} ({kind})"
        if kind == "tool_result":
            inner = _media_in(b["content"], f"{path}.{j}.content")
            if inner is not None:
                return inner
    return None


def _stops(value: list[str] | None) -> list[str]:
    if not value:
        return []
    if len(value) > 16:
        raise ConversionError(f"Stop string array too long: {len(value)}")
    for i, s in enumerate(value):
        if not s:
            raise ConversionError(
                f"Invalid 'stop[{i}]': empty string. Expected a string with minimum length 1, but got an empty "
                "string instead."
            )
    return value


def _tools(raw: list[dict[str, Any]]) -> list[ToolSpec]:
    tools: list[ToolSpec] = []
    for i, t in enumerate(raw):
        if any(seen.name == t["name"] for seen in tools):
            raise ConversionError("Tool names must be unique.")
        tools.append(common.tool_spec(
            t["name"], t["description"], t["input_schema"], None, where=f"tools[{i}].name", required_schema=True
        ))
    return tools


def _choice(
    value: tuple[str, dict[str, Any]] | None, raw: list[dict[str, Any]], thinking: bool
) -> tuple[list[ToolSpec], cv.ToolChoice]:
    kind = value[0] if value else "auto"
    if kind == "none":  # the tools are not offered, so not even checked
        return [], "none"
    tools = _tools(raw)
    if not tools:
        return [], "auto"
    if kind != "tool":  # "any" is served as "auto", like the reference does
        return tools, "auto"
    name = value[1]["name"]  # type: ignore[index]
    picked = [t for t in tools if t.name == name]
    if not picked:
        raise ConversionError(
            f"Invalid value for 'tool_call': no function named '{name}' was specified in the 'tools' parameter."
        )
    if thinking:
        raise ConversionError("Thinking mode does not support this tool_choice")
    return picked, "required"


def _block_piece(kind: str, block: dict[str, Any], encoding: str, path: str, where: str = "") -> images.Piece:
    """A block as a message part: V4.1 reads an image block's source (`path` locates the image for the
    resolver, `where` the block in conversion errors; the same but in tool results)."""
    if kind != "image" or encoding != "v41":
        return _block_text(kind, block)
    source_kind, source = block["source"]
    if source_kind == "base64":
        return images.base64_block(source["media_type"], source["data"], path, where or path)
    if source_kind == "url":
        return images.url_block(source["url"], path, where or path)
    return _block_text(kind, block)


def _block_text(kind: str, block: dict[str, Any]) -> str:
    if kind == "text":
        return block["text"]
    if kind == "image":
        return "[Unsupported Image]"
    source = block.get("source")
    media = source.get("media_type") if isinstance(source, dict) else None
    return f"[Unsupported document type: {media if isinstance(media, str) else 'unknown'}]"


def _messages(
    req: MessagesRequest, thinking: bool, options: ConvertOptions, tool_names: set[str], encoding: str
) -> list[Message]:
    out: list[Message] = []
    system = req.system
    if system is not None:
        out.append(cv.system(system if isinstance(system, str) else "\n\n".join(b["text"] for _, b in system)))
    raw = req.messages
    for i, (role, content) in enumerate(raw):
        if role != "system" and not content and not isinstance(content, str):
            raise ConversionError(f"messages.{i}: all messages must have non-empty content")
        blocks = [("text", {"text": content})] if isinstance(content, str) else content
        if role == "assistant":
            if i > 0 and _calls_of(raw[i - 1]):
                _check_results(i - 1, raw)
            out.append(_assistant(i, blocks, thinking, options, encoding))
        else:
            out.extend(_user(i, role, blocks, raw, tool_names, encoding))
            if i > 0 and _calls_of(raw[i - 1]):  # after this message's own result checks
                _check_results(i - 1, raw)
    if _calls_of(raw[-1]):
        _check_results(len(raw) - 1, raw)
    return out


def _assistant(
    i: int, blocks: list[tuple[str, dict[str, Any]]], thinking: bool, options: ConvertOptions, encoding: str,
) -> Message:
    reasoning: list[str] = []
    texts: list[str] = []
    calls: list[cv.ToolCall] = []
    for j, (kind, b) in enumerate(blocks):
        if kind == "tool_result":
            raise ConversionError(f"messages.{i}: `tool_result` blocks can only be in `user` messages")
        if kind in ("server_tool_use", "web_search_tool_result"):
            raise ConversionError("Unsupported content block: server tools are not supported")
        if kind == "thinking":
            reasoning.append(b["thinking"])
        elif kind == "tool_use":
            if any(c.id == b["id"] for c in calls):
                raise ConversionError(f"messages.{i}.content.{j}: `tool_use` ids must be unique")
            calls.append(cv.ToolCall(b["id"], b["name"], dumps(b["input"], "spaced")))
        elif calls and kind != "thinking":
            ids = ", ".join(c.id for c in calls)
            raise ConversionError(
                f"messages.{i}.{j}: `tool_use` ids were found without `tool_result` blocks immediately after: {ids}. "
                "Each `tool_use` block must have a corresponding `tool_result` block in the next message."
            )
        else:
            if kind == "image" and encoding == "v41":  # its source is read (and may be refused) first
                _block_piece(kind, b, encoding, f"messages.{i}.content[{j}]")
                raise ConversionError("Image in assistant message is unsupported")
            texts.append(_block_text(kind, b))
    text_reasoning: str | None = "\n\n".join(reasoning) if reasoning else None
    if not thinking:
        text_reasoning = None
    elif text_reasoning is None:
        if not options.fill_missing_reasoning:
            raise ConversionError("The `content[].thinking` in the thinking mode must be passed back to the API.")
        text_reasoning = ""
    return cv.assistant(_join(texts), text_reasoning, tuple(calls) or None)


def _join(parts: list[str]) -> str:
    """Blank-line join that drops empty parts before the first non-empty one (the reference appends to the text
    so far, starting over while it is empty)."""
    out = ""
    for part in parts:
        out = out + "\n\n" + part if out else part
    return out


def _check_results(i: int, raw: list[tuple[str, Any]]) -> None:
    """The message after tool calls must be a user message opening with one tool_result per call."""
    calls = _calls_of(raw[i])
    answered: set[str] = set()
    if i + 1 < len(raw) and raw[i + 1][0] == "user" and not isinstance(raw[i + 1][1], str):
        for kind, b in raw[i + 1][1]:
            if kind != "tool_result":
                break
            answered.add(b["tool_use_id"])
    missing = sorted(c for c in calls if c not in answered)
    if missing:
        # Worded after the next message when it does not even start with a result, else after this one.
        where = f"messages.{i}:"
        if i + 1 < len(raw) and not _only_results(raw[i + 1]):
            where = f"messages.{i + 1}: "
        raise ConversionError(
            f"{where}`tool_use` ids were found without `tool_result` blocks immediately after: {', '.join(missing)}. "
            "Each `tool_use` block must have a corresponding `tool_result` block in the next message."
        )


def _user(
    i: int, role: str, blocks: list[tuple[str, dict[str, Any]]], raw: list[tuple[str, Any]], tool_names: set[str],
    encoding: str,
) -> list[Message]:
    out: list[Message] = []
    prev_calls = _calls_of(raw[i - 1]) if i > 0 else []
    seen: set[str] = set()
    texts: list[images.Piece] = []
    for j, (kind, b) in enumerate(blocks):
        if kind == "tool_use":
            raise ConversionError(f"messages.{i}: `tool_use` blocks can only be in `assistant` messages")
        if kind == "thinking":
            raise ConversionError(f"messages.{i}.content: thinking blocks may only be in `assistant` messages")
        if kind == "web_search_tool_result":
            raise ConversionError(f"messages.{i}: `web_search_tool_result` blocks can only be in `assistant` messages")
        if kind == "server_tool_use":
            raise ConversionError("Unsupported content block: server tools are not supported")
        if kind == "tool_result":
            call_id = b["tool_use_id"]
            if call_id in seen:
                raise ConversionError(
                    f"messages.{i}.content.{j}: each tool_use must have a single result. Found multiple "
                    f"`tool_result` blocks with id: {call_id}"
                )
            if call_id not in prev_calls:
                raise ConversionError(
                    f"unexpected `messages.{i}.content.{j}: tool_use_id` found in `tool_result` blocks: {call_id}. "
                    "Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
                )
            seen.add(call_id)
            text, shown = _result_text(i, j, b["content"], tool_names, encoding)
            out.append(cv.tool(text, call_id, shown))
        elif kind == "tool_addition":
            continue
        else:
            # a system message's images are located by the message, a user block by itself (as the reference)
            where = f"messages.{i}" if role == "system" else f"messages.{i}.content[{j}]"
            texts.append(_block_piece(kind, b, encoding, where))
    if role == "system":
        text, shown = images.join(texts)
        if encoding == "v41":  # V4.1 has system turns; V4 gets the instruction as a tagged user message
            return [*out, cv.system(text, shown)]
        return [*out, cv.user(f"<system-reminder>\n{text}\n</system-reminder>")] if text else out
    return [*out, *(cv.user(*images.join([t])) for t in texts)]


def _only_results(message: tuple[str, Any]) -> bool:
    content = message[1]
    return not isinstance(content, str) and all(kind == "tool_result" for kind, _ in content)


def _calls_of(message: tuple[str, Any]) -> list[str]:
    role, content = message
    if role != "assistant" or isinstance(content, str):
        return []
    return [b["id"] for kind, b in content if kind == "tool_use"]


def _result_text(i: int, j: int, content: Any, tool_names: set[str], encoding: str) -> tuple[str, cv.Images]:
    if content is None or isinstance(content, str):
        return content or "", cv.NO_IMAGES
    parts: list[images.Piece] = []
    for k, (kind, b) in enumerate(content):
        if kind == "tool_reference":
            if b["tool_name"] not in tool_names:
                raise ConversionError(f"messages.{i}.content.{j}: tool reference '{b['tool_name']}' not found in "
                                      "available tools")
            continue
        where = f"messages.{i}.content.{j}.tool_result"
        parts.append(_block_piece(kind, b, encoding, where, f"{where}.content[{k}]"))
    return images.join(parts)
