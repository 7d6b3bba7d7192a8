r"""The `input` of an OpenAI Responses request: items -> messages, with the reference's rules.

`instructions` is a leading system message; a developer message is a system one, but a user one in V4 (which has
no system turns mid-conversation): `common.developer_role`. The assistant side of a turn (reasoning items,
assistant messages, function and custom tool calls) becomes one assistant message; its calls keep gathering
while some wait for their outputs, which must follow before anything else:

    [reasoning] [assistant text] [call a] [call b] [output b] [call c] [output a] [output c] [user ...]
     \____________________ one assistant message, calls a b c ________________/  results a b c

Item types the reference skips (item references, tool searches, unknown types) are skipped here too.
"""

from __future__ import annotations

from typing import Any

from services.recipe import conversation as cv
from services.recipe.conversation import Message, ToolCall
from services.recipe.convert import images
from services.recipe.convert.common import developer_role
from services.recipe.convert.options import ConvertOptions
from services.recipe.convert.serde import Any_, Custom, Enum, Field, Opt, Seq, Str, Struct, Tagged, invalid_type
from services.recipe.errors import BodyError, ConversionError
from services.recipe.formats.jsontext import dumps

_TEXT_PARTS = {"input_text", "output_text"}
_PLACEHOLDERS = {"input_image": "[Unsupported Image]", "input_file": "[Unsupported Document]"}
_IMAGE = Struct("ResponsesInputImage", [
    Field("image_url", Opt(Str)), Field("file_id", Opt(Str)),
    Field("detail", Opt(Enum(["low", "high", "original", "auto"]))),
])
_FILE = Struct("InputFile", [Field("file_id", Any_), Field("file_data", Any_), Field("filename", Any_)])
_PART = Tagged("ResponsesContentBlock", "type", {
    "input_text": Struct("InputText", [Field("text", Str, required=True)]),
    "output_text": Struct("OutputText", [Field("text", Str, required=True)]),
    "input_image": _IMAGE, "input_file": _FILE,
})
_OUTPUT_PART = Tagged("ResponsesToolCallOutputItem", "type", {
    "input_text": Struct("InputText", [Field("text", Str, required=True)]), "input_image": _IMAGE,
    "input_file": _FILE,
})


def _parts(message: str, part: Tagged = _PART) -> Custom:
    def read(value: Any) -> list[tuple[str, Any]] | str:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return [part.read(v) for v in value]
        raise BodyError(message)

    return Custom(read)


def _map(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid_type(value, "a map")
    return value


_MESSAGE = Struct("ResponsesInputMessage", [
    Field("role", Enum(["user", "assistant", "system", "developer"]), required=True),
    Field("content", _parts("content should be a string or a list of content blocks"), required=True),
])
_ITEMS: dict[str, Struct] = {
    "message": _MESSAGE,
    "function_call": Struct("ResponsesFunctionCall", [
        Field("call_id", Str, required=True), Field("name", Str, required=True),
        Field("arguments", Str, required=True), Field("namespace", Opt(Str)),
    ]),
    "function_call_output": Struct("ResponsesFunctionCallOutput", [
        Field("call_id", Opt(Str)),
        Field("output", _parts("output should be a string or a list of output content parts", _OUTPUT_PART),
              required=True),
    ]),
    "reasoning": Struct("ResponsesReasoningItem", [
        Field("summary", Any_),
        Field("content", Opt(Seq(Struct("ResponsesReasoningContent", [Field("text", Str, required=True)])))),
    ]),
    "custom_tool_call": Struct("ResponsesCustomToolCall", [
        Field("call_id", Str, required=True), Field("name", Str, required=True), Field("input", Str, required=True),
    ]),
    "tool_search_call": Struct("ResponsesToolSearchCall", [Field("arguments", Custom(_map), required=True)]),
    "tool_search_output": Struct("ResponsesToolSearchOutput", [Field("tools", Seq(Any_), required=True)]),
    "web_search_call": Struct("WebSearchCall", []),
    "custom_tool_call_output": Struct("ResponsesCustomToolCallOutput", [
        Field("call_id", Str, required=True),
        Field("output", Opt(_parts("output should be a string or a list of output content parts", _OUTPUT_PART))),
    ]),
}


def _item(value: Any) -> tuple[str, dict[str, Any]] | None:
    """(kind, fields); None for item types the reference ignores (web search calls, references...)."""
    if not isinstance(value, dict) or ("type" not in value and "role" not in value):
        raise BodyError("invalid input item")
    if "type" in value:
        kind = value["type"]
        if not isinstance(kind, str):
            raise invalid_type(kind, "variant identifier")
        struct = _ITEMS.get(kind)
        return None if struct is None else (kind, struct.read(value))
    return "message", _MESSAGE.read(value)


def read_input(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [_item(v) for v in value]
    raise BodyError("input should be a string or a list of input items")


def _text(content: list[tuple[str, Any]] | str) -> str:
    if isinstance(content, str):
        return content
    return "\n\n".join(p["text"] if kind in _TEXT_PARTS else _PLACEHOLDERS[kind] for kind, p in content)


def _content(content: list[tuple[str, Any]] | str, encoding: str, i: int, key: str) -> tuple[str, cv.Images]:
    """A message's (or an output's) parts: V4 as `_text`; V4.1 images become placeholders and sources, checked
    as the reference checks them (`key` names the list in error locations: "content" or "output")."""
    if encoding != "v41" or isinstance(content, str):
        return _text(content), cv.NO_IMAGES
    for j, (kind, p) in enumerate(content):  # every part's shape first, then the URLs (the reference's order)
        if kind == "input_image":
            _check_image_part(p, f"input[{i}].{key}[{j}]")
    pieces: list[images.Piece] = []
    for j, (kind, p) in enumerate(content):
        if kind != "input_image":
            pieces.append(p["text"] if kind in _TEXT_PARTS else _PLACEHOLDERS[kind])
            continue
        where = f"input[{i}].{key}[{j}]"
        pieces.append(images.image_url(p["image_url"], p["detail"], f"input[{i}]", f"{where}: image_url"))
    return images.join(pieces)


def _check_image_part(p: dict[str, Any], where: str) -> None:
    """One URL or one file id (an empty URL counts as none); a file id is refused, a long URL too."""
    url = p["image_url"] or None
    if url is not None and p["file_id"] is not None:
        raise ConversionError(f"{where}: input_image cannot have both image_url and file_id")
    if url is None and p["file_id"] is None:
        raise ConversionError(f"{where}: input_image must have image_url or file_id")
    if url is None:
        raise ConversionError(f"{where}: file_id is not supported. Pass the image as a base64 data url instead.")
    images.check_url_length(url, f"{where}: image_url")


def _assistant_text(content: list[tuple[str, Any]] | str, encoding: str, i: int) -> str:
    """V4.1 refuses an image in assistant content, once each image part is well formed (the URL unread)."""
    if encoding == "v41" and not isinstance(content, str):
        found = [(j, p) for j, (kind, p) in enumerate(content) if kind == "input_image"]
        for j, p in found:
            _check_image_part(p, f"input[{i}].content[{j}]")
        if found:
            raise ConversionError(f"input[{i}]: Image in assistant message is unsupported")
    return _text(content)


class _Turn:
    """The assistant side of a turn being gathered: reasoning, then answer text, then calls and their outputs.
    Calls keep joining the turn while some are unanswered; once all are answered, a new call opens a new turn."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.outputs: dict[str, tuple[str, cv.Images]] = {}

    def unanswered(self) -> list[str]:
        return sorted(c.id for c in self.calls if c.id not in self.outputs)

    def messages(self, thinking: bool, options: ConvertOptions) -> list[Message]:
        reasoning: str | None = "\n".join(self.reasoning) if self.reasoning else None
        if not thinking:
            reasoning = None
        elif reasoning is None:
            if not options.fill_missing_reasoning:
                raise ConversionError("The `reasoning_text` in the thinking mode must be passed back to the API.")
            reasoning = ""
        calls = sorted(self.calls, key=lambda c: c.id)  # the reference keys a turn's calls by id
        answer = cv.assistant("\n\n".join(self.content), reasoning, tuple(calls) or None)
        return [answer, *(cv.tool(self.outputs[c.id][0], c.id, self.outputs[c.id][1]) for c in calls)]


def input_messages(
    raw: str | list[Any] | None, instructions: str | None, thinking: bool, options: ConvertOptions, encoding: str
) -> list[Message]:
    if raw is None and not instructions:
        raise ConversionError("Either input or instructions must be provided")
    if isinstance(raw, list) and not raw:
        raise ConversionError("Input items array must not be empty")
    out: list[Message] = [cv.system(instructions)] if instructions else []
    if isinstance(raw, str):
        return [*out, cv.user(raw)]
    turn: _Turn | None = None
    call_ids: set[str] = set()  # unique across the whole input
    answered: set[str] = set()

    def close() -> None:
        nonlocal turn
        if turn is not None:
            out.extend(turn.messages(thinking, options))
            turn = None

    for i, item in enumerate(raw or []):
        if item is None or item[0] in ("tool_search_call", "tool_search_output"):
            continue  # items the reference skips
        kind, f = item
        # A web search call (dropped) or an output for no call is skipped, but still ends a turn whose calls
        # wait for outputs.
        if kind == "web_search_call" or (kind == "function_call_output" and f["call_id"] is None):
            if turn is not None and turn.unanswered():
                raise ConversionError(f"No tool output found for tool call {turn.unanswered()[0]}.")
            continue
        if kind in ("function_call_output", "custom_tool_call_output"):
            call_id = f["call_id"]
            if call_id in answered:
                raise ConversionError(f"Duplicate tool output for call_id: {call_id}.")
            if turn is None or call_id not in turn.unanswered():
                raise ConversionError(f"No tool call found for tool output with call_id {call_id}.")
            answered.add(call_id)
            turn.outputs[call_id] = _content(f["output"] or "", encoding, i, "output")
            continue
        if kind in ("function_call", "custom_tool_call"):
            if not f["call_id"]:
                raise ConversionError(
                    f"Invalid 'input[{i}].call_id': empty string. Expected a string with minimum length 1, but got "
                    "an empty string instead."
                )
            if f["call_id"] in call_ids:
                raise ConversionError(f"Duplicate 'call_id': {f['call_id']}.")
            call_ids.add(f["call_id"])
            if turn is not None and turn.calls and not turn.unanswered():
                close()
            turn = turn or _Turn()
            turn.calls.append(_call(kind, f, encoding))
            continue
        if turn is not None and turn.unanswered():
            raise ConversionError(f"No tool output found for tool call {turn.unanswered()[0]}.")
        if kind == "reasoning":
            texts = ["\n".join(c["text"] for c in f["content"] or [])]
            if not texts[0]:  # an empty reasoning item says nothing (and does not split the turn)
                continue
            if turn is not None and (turn.content or turn.calls):
                close()
            turn = turn or _Turn()
            turn.reasoning.extend(texts)
            continue
        role = f["role"]
        if role == "assistant":
            if turn is not None and turn.calls:
                close()
            turn = turn or _Turn()
            text = _assistant_text(f["content"], encoding, i)
            if text:
                turn.content.append(text)
            continue
        close()
        text, shown = _content(f["content"], encoding, i, "content")
        kind = developer_role(encoding) if role == "developer" else role
        out.append(Message(kind, text, images=shown[0], image_at=shown[1]))
    if turn is not None and turn.unanswered():
        raise ConversionError(f"No tool output found for tool call {turn.unanswered()[0]}.")
    close()
    return out


def _call(kind: str, f: dict[str, Any], encoding: str) -> ToolCall:
    if kind == "custom_tool_call":
        return ToolCall(f["call_id"], f["name"], dumps({"input": f["input"]}, "compact"))
    name = namespaced(f["namespace"], f["name"], encoding) if f.get("namespace") else f["name"]
    return ToolCall(f["call_id"], name, f["arguments"])


def namespaced(namespace: str, name: str, encoding: str) -> str:
    """A namespace's function as the model sees it: "ns__name" for V4, "ns::name" for V4.1."""
    return f"{namespace}{'::' if encoding == 'v41' else '__'}{name}"


