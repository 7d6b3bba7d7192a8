"""Any HF chat model (SmolLM2, ...): the conversation flattened to role/content messages for the model's own
jinja template (`services.recipe.chat_template.ChatTemplate`).

Such templates know system/user/assistant text only, so what they cannot express is refused with a clear 400
rather than dropped: tools and tool calls, reasoning, latest reminders, thinking mode and JSON output formats.
A Chat Completions prefix (`"prefix": true` on the final assistant message) is continued, as HF's
`continue_final_message` does.
"""

from __future__ import annotations

from typing import Any, Protocol

from services.recipe.chat_template import ChatTemplate, TemplateError
from services.recipe.conversation import Conversation
from services.recipe.convert.options import ConversionError


class TemplateModel(Protocol):
    """What rendering needs of a served model (`services.recipe.model.ServedModel` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def template(self) -> ChatTemplate | None: ...


def flatten(conv: Conversation, model_name: str) -> list[dict[str, Any]]:
    """role/content messages, or ConversionError naming the first feature the template cannot express."""
    def refuse(what: str) -> ConversionError:
        return ConversionError(f"{what} not supported by model {model_name}")

    if conv.thinking:
        raise refuse("thinking mode is")
    if conv.offers_tools:
        raise refuse("tools are")
    if conv.response_format.kind != "text":
        raise refuse(f"response_format {conv.response_format.kind} is")
    out: list[dict[str, Any]] = []
    for msg in conv.messages:
        if msg.role in ("tool", "latest_reminder"):
            raise refuse(f"{msg.role} messages are")
        if msg.tool_calls:
            raise refuse("tool calls are")
        if msg.reasoning_content:
            raise refuse("reasoning_content is")
        out.append({"role": msg.role, "content": msg.content})
    return out


def render(conv: Conversation, model: TemplateModel, *, add_generation_prompt: bool = True) -> str:
    """`add_generation_prompt=False` (vLLM's /tokenize) leaves out the opening of the assistant's turn."""
    if model.template is None:
        raise ConversionError(f"model {model.name} has no chat template; use the completions API")
    messages = flatten(conv, model.name)
    try:
        return model.template.render(
            messages, add_generation_prompt=add_generation_prompt, continue_final_message=conv.continues_prefix
        )
    except TemplateError as exc:  # the template refused the conversation: the client's to fix
        raise ConversionError(str(exc)) from None
