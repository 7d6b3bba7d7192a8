"""Any HF chat model (SmolLM2, ...): the conversation flattened to role/content messages for the model's own
jinja template (`services.recipe.chat_template.ChatTemplate`).

Such templates know system/user/assistant text only, so what they cannot express is refused with a clear 400
rather than dropped: tools and tool calls, reasoning, latest reminders and thinking mode. A response_format is not
written into the prompt (the template has no place for it): constrained decoding enforces it, as vLLM does.
A Chat Completions prefix (`"prefix": true` on the final assistant message) is continued, as HF's
`continue_final_message` does.

Client text is text: `encode` renders the template with every control-token spelling inside a message replaced
by a placeholder, so the control tokens left in the rendered prompt are the template's own; it then puts the
client's spellings back and encodes the prompt once with only the template's spans read as control tokens
(`Tokenizer.encode_marked`). A user who types `<|im_end|>\n<|im_start|>assistant` gets the ordinary pieces of
those characters and cannot forge a turn. A conversation whose text spells no control token is encoded whole,
exactly as before. `ChatTemplate.trusts_client_text` (the recipe's --allow-control-tokens-in-user-text) turns
the old reading back on: the rendered prompt encoded whole, client spellings included (what vLLM does).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Any, Protocol

from services.recipe.chat_template import ChatTemplate
from services.recipe.conversation import Conversation
from services.recipe.errors import ConversionError, TemplateError


class TemplateModel(Protocol):
    """What rendering needs of a served model (`services.recipe.model.ServedModel` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def template(self) -> ChatTemplate | None: ...

    @property
    def tokenizer(self) -> TemplateTokenizer: ...


class TemplateTokenizer(Protocol):
    """What encoding needs of a tokenizer (`shared.tokenizer.Tokenizer` is one)."""

    @property
    def control_texts(self) -> tuple[str, ...]: ...  # longest first

    def encode(self, text: str) -> list[int]: ...

    def encode_marked(self, text: str, control_ranges: Sequence[tuple[int, int]]) -> list[int]: ...


def flatten(conv: Conversation, model_name: str) -> list[dict[str, Any]]:
    """role/content messages, or ConversionError naming the first feature the template cannot express."""
    def refuse(what: str) -> ConversionError:
        return ConversionError(f"{what} not supported by model {model_name}")

    if conv.thinking:
        raise refuse("thinking mode is")
    if conv.offers_tools:
        raise refuse("tools are")
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
    return _render(conv, model, flatten(conv, model.name), add_generation_prompt)


def encode(conv: Conversation, model: TemplateModel, *, add_generation_prompt: bool = True
           ) -> tuple[str, list[int]]:
    """(prompt, token ids), the client's text encoded as text (see the module's docstring)."""
    tokenizer = model.tokenizer
    messages = flatten(conv, model.name)
    spelled = _Spellings(tokenizer.control_texts)
    escaped = [spelled.escape(m) for m in messages]
    if not spelled.literals or (model.template is not None and model.template.trusts_client_text):
        text = _render(conv, model, messages, add_generation_prompt)
        return text, tokenizer.encode(text)  # nothing to tell apart: encoded whole, as it always was
    prompt, ranges = spelled.restore(_render(conv, model, escaped, add_generation_prompt))
    return prompt, tokenizer.encode_marked(prompt, ranges)


def _render(conv: Conversation, model: TemplateModel, messages: list[dict[str, Any]],
            add_generation_prompt: bool) -> str:
    if model.template is None:
        raise ConversionError(f"model {model.name} has no chat template; use the completions API")
    try:
        return model.template.render(
            messages, add_generation_prompt=add_generation_prompt, continue_final_message=conv.continues_prefix
        )
    except TemplateError as exc:  # the template refused the conversation: the client's to fix
        raise ConversionError(str(exc)) from None


class _Spellings:
    """Client text's control-token spellings swapped for placeholders before rendering, and back after.

    A placeholder is private-use characters around a per-request random number and the literal's index: no case
    or trim a template applies changes it, and no client can spell one in advance."""

    def __init__(self, controls: tuple[str, ...]) -> None:
        self._controls = re.compile("|".join(re.escape(t) for t in controls)) if controls else None
        self._nonce = secrets.randbelow(10**12)
        self.literals: list[str] = []

    def escape(self, message: dict[str, Any]) -> dict[str, Any]:
        content = message["content"]
        if self._controls is None or not self._controls.search(content):
            return message
        return {**message, "content": self._controls.sub(self._placeholder, content)}

    def _placeholder(self, m: re.Match[str]) -> str:
        self.literals.append(m.group())
        return f"\ue000{self._nonce}.{len(self.literals) - 1}\ue001"

    def restore(self, rendered: str) -> tuple[str, list[tuple[int, int]]]:
        """The prompt with the client's spellings back, and the spans of the template's own control tokens."""
        assert self._controls is not None, "restore follows an escape that found a spelling"
        either = re.compile(rf"\ue000{self._nonce}\.(\d+)\ue001|{self._controls.pattern}")
        out: list[str] = []
        ranges: list[tuple[int, int]] = []
        length = pos = 0
        for m in either.finditer(rendered):
            out.append(rendered[pos : m.start()])
            length += m.start() - pos
            piece = self.literals[int(m.group(1))] if m.group(1) is not None else m.group()
            if m.group(1) is None:
                ranges.append((length, length + len(piece)))
            out.append(piece)
            length += len(piece)
            pos = m.end()
        out.append(rendered[pos:])
        return "".join(out), ranges
