"""Any HF chat model (SmolLM2, ...): the conversation flattened to role/content messages for the model's own
jinja template (`services.recipe.chat_template.ChatTemplate`).

Tools, past tool calls and tool results are rendered the template's own way when it reads `tools` (HF's
convention: Qwen2.5, Hermes, Llama 3.1), else the Hermes way, written into the messages' text (formats/hermes.py:
a system block listing the tools, `<tool_call>` markup for past calls, `<tool_response>` user turns for results);
the model answers with Hermes calls either way (parse/hermes.py reads them). What such templates cannot express is
refused with a clear 400 rather than dropped: reasoning, latest reminders and thinking mode. A response_format is not
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
from services.recipe.formats import hermes
from services.recipe.formats.dsml import call_arguments


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


def flatten(conv: Conversation, model: TemplateModel) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(role/content messages, the tools for a template that reads `tools`), or ConversionError naming the first
    feature the template cannot express. Tools, past calls and tool results go the template's own way when it
    reads `tools`, else the Hermes way into the messages' text (formats/hermes.py)."""
    def refuse(what: str) -> ConversionError:
        return ConversionError(f"{what} not supported by model {model.name}")

    if conv.thinking:
        raise refuse("thinking mode is")
    native = model.template is not None and model.template.takes_tools
    out: list[dict[str, Any]] = []
    results_at = -1  # the Hermes way: the user turn of the tool results just before (results in a row share it)
    for msg in conv.messages:
        if msg.role == "latest_reminder":
            raise refuse(f"{msg.role} messages are")
        if msg.reasoning_content:
            raise refuse("reasoning_content is")
        if msg.role == "tool" and not native:
            if results_at == len(out) - 1 >= 0:
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + hermes.response(msg.content)}
            else:
                out.append({"role": "user", "content": hermes.response(msg.content)})
                results_at = len(out) - 1
            continue
        if msg.role == "tool":
            out.append({"role": "tool", "content": msg.content, "tool_call_id": msg.tool_call_id})
        elif msg.tool_calls and native:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.name, "arguments": call_arguments(c.arguments)}} for c in msg.tool_calls]
            out.append({"role": "assistant", "content": msg.content, "tool_calls": calls})
        elif msg.tool_calls:
            written = "\n".join(hermes.call(c.name, c.arguments) for c in msg.tool_calls)
            out.append({"role": "assistant", "content": f"{msg.content}\n{written}" if msg.content else written})
        else:
            out.append({"role": msg.role, "content": msg.content})
    if not conv.offers_tools:
        return out, None
    if native:
        return out, [hermes.function(t) for t in conv.tools if not t.defer_loading]
    block = hermes.system_block(conv.tools)
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{block}"}, *out[1:]], None
    return [{"role": "system", "content": block}, *out], None


def render(conv: Conversation, model: TemplateModel, *, add_generation_prompt: bool = True) -> str:
    """`add_generation_prompt=False` (vLLM's /tokenize) leaves out the opening of the assistant's turn."""
    messages, tools = flatten(conv, model)
    return _render(conv, model, messages, tools, add_generation_prompt)


def encode(conv: Conversation, model: TemplateModel, *, add_generation_prompt: bool = True
           ) -> tuple[str, list[int]]:
    """(prompt, token ids), the client's text encoded as text (see the module's docstring)."""
    tokenizer = model.tokenizer
    messages, tools = flatten(conv, model)
    spelled = _Spellings(tokenizer.control_texts)
    escaped = [spelled.escape(m) for m in messages]
    escaped_tools = spelled.escape_value(tools)
    if not spelled.literals or (model.template is not None and model.template.trusts_client_text):
        text = _render(conv, model, messages, tools, add_generation_prompt)
        return text, tokenizer.encode(text)  # nothing to tell apart: encoded whole, as it always was
    prompt, ranges = spelled.restore(_render(conv, model, escaped, escaped_tools, add_generation_prompt))
    return prompt, tokenizer.encode_marked(prompt, ranges)


def _render(conv: Conversation, model: TemplateModel, messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None, add_generation_prompt: bool) -> str:
    if model.template is None:
        raise ConversionError(f"model {model.name} has no chat template; use the completions API")
    extra = {} if tools is None else {"tools": tools}
    try:
        return model.template.render(
            messages, add_generation_prompt=add_generation_prompt, continue_final_message=conv.continues_prefix,
            **extra,
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
        """Every string of the message (its content, a native template's past calls) escaped."""
        return self.escape_value(message)

    def escape_value(self, value: Any) -> Any:
        if isinstance(value, str):
            if self._controls is None or not self._controls.search(value):
                return value
            return self._controls.sub(self._placeholder, value)
        if isinstance(value, dict):
            return {k: self.escape_value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.escape_value(v) for v in value]
        return value

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
