"""One conversation model for every API: what a request asks the model to continue, API-neutral.

Every API conversion (`services.recipe.convert`) produces a `Conversation`; every prompt format
(`services.recipe.formats`) renders one. It mirrors deepseek-recipe's `Conversation` (the oracle for the
DeepSeek formats): messages of five roles, client tools, the tool choice, thinking mode and reasoning effort,
and the requested answer format. Message content is already flattened to text by the conversion.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from services.recipe.images.sources import ImageSource
from services.recipe.prepared import ToolSpec

Role = Literal["system", "user", "assistant", "tool", "latest_reminder"]
ToolChoice = Literal["auto", "none", "required"]
# The efforts a prompt format knows; each API maps its own spellings onto these ("medium" -> "high", ...).
ReasoningEffort = Literal["low", "high", "xhigh", "max"]
ResponseKind = Literal["text", "json_object", "json_schema", "regex"]


@dataclass(frozen=True)
class ToolCall:
    """A tool call in the history. `arguments` is the client's text, meant to encode a JSON object; formats
    parse it themselves (a malformed one is kept as a single string argument, never refused)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    role: Role
    content: str = ""
    reasoning_content: str | None = None  # assistant only; None = the client sent none
    tool_calls: tuple[ToolCall, ...] | None = None  # assistant only; () is kept apart from None (V4 renders it)
    tool_call_id: str | None = None  # tool only
    prefix: bool = False  # assistant only: the final message is continued, not answered
    # system, user and tool (V4.1): image sources and where their placeholders (`<｜image｜>`) start in
    # `content`; the same spelling typed by the client elsewhere in the text stays text
    images: tuple[ImageSource, ...] = ()
    image_at: tuple[int, ...] = ()


Images = tuple[tuple[ImageSource, ...], tuple[int, ...]]  # sources and their placeholder offsets
NO_IMAGES: Images = ((), ())


def system(content: str, images: Images = NO_IMAGES) -> Message:
    return Message("system", content, images=images[0], image_at=images[1])


def user(content: str, images: Images = NO_IMAGES) -> Message:
    return Message("user", content, images=images[0], image_at=images[1])


def assistant(
    content: str = "", reasoning: str | None = None, tool_calls: tuple[ToolCall, ...] | None = None,
    prefix: bool = False,
) -> Message:
    return Message("assistant", content, reasoning, tool_calls, prefix=prefix)


def tool(content: str, tool_call_id: str | None, images: Images = NO_IMAGES) -> Message:
    return Message("tool", content, tool_call_id=tool_call_id, images=images[0], image_at=images[1])


def latest_reminder(content: str) -> Message:
    return Message("latest_reminder", content)


@dataclass(frozen=True)
class ResponseFormat:
    kind: ResponseKind = "text"
    schema: Any = None  # json_schema: the JSON schema (parsed JSON)
    regex: str | None = None  # regex: the pattern


TEXT = ResponseFormat()


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = "auto"
    thinking: bool = True
    reasoning_effort: ReasoningEffort | None = None  # None = the format's default
    response_format: ResponseFormat = field(default=TEXT)

    @property
    def offers_tools(self) -> bool:
        """Whether the prompt presents tools to the model (a `none` choice hides them)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def continues_prefix(self) -> bool:
        """Whether the final message is an assistant prefix the model continues (Chat Completions beta)."""
        return bool(self.messages) and self.messages[-1].role == "assistant" and self.messages[-1].prefix
