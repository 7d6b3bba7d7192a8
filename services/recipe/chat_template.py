"""A model's own jinja chat template, rendered the way HF transformers renders it.

Same environment as `transformers.utils.chat_template_utils`: a sandbox (templates come with checkpoints and
are untrusted code), trim_blocks + lstrip_blocks, the `loopcontrols` extension, a no-op `{% generation %}`
block, `raise_exception`, `strftime_now`, and a `tojson` that keeps non-ASCII text as is.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.recipe.errors import TemplateError


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering ignores it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 trusts_client_text: bool = False) -> None:
        """`trusts_client_text`: control tokens spelled in client text are read as control tokens (the unsafe
        old reading, --allow-control-tokens-in-user-text); by default they are text
        (`services.recipe.formats.chat_template.encode`)."""
        self.trusts_client_text = trusts_client_text
        env = _environment()
        try:
            self._template = env.from_string(source)
            free = jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from None
        # a template that reads `tools` renders them, past calls and tool results its own way (Qwen2.5, Hermes,
        # Llama 3.1: HF's convention); one that does not gets them the Hermes way (formats/hermes.py)
        self.takes_tools = "tools" in free
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """The prompt text. With `continue_final_message` the last (assistant) message is left open so the
        model continues it, as HF does: render it whole, then cut right after its content."""
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                **self._tokens,
                **extra,
            )
        except jinja2.exceptions.TemplateError as exc:  # includes raise_exception and sandbox violations
            raise TemplateError(str(exc)) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise TemplateError(f"chat template failed on this conversation: {exc}") from None
        if continue_final_message:
            final = str(messages[-1].get("content", "")).strip()
            cut = text.rfind(final)
            if not final or cut < 0:
                raise TemplateError("the final assistant message cannot be continued with this chat template")
            text = text[: cut + len(final)]
        return text
