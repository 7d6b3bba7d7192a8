"""One served model as the codec sees it: name, prompt format, tokenizer (and its detokenizing table), context
length and chat template."""

from __future__ import annotations

from dataclasses import dataclass

from services.recipe.chat_template import ChatTemplate
from services.recipe.convert.options import Encoding
from services.recipe.parse.detok import TokenTable
from shared.model_info import ModelInfo, load_model_info
from shared.models import resolve
from shared.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class ServedModel:
    info: ModelInfo
    tokenizer: Tokenizer
    tokens: TokenTable
    template: ChatTemplate | None
    encoding: Encoding

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def context_length(self) -> int:
        return self.info.context_length

    @classmethod
    def load(cls, spec: str) -> ServedModel:
        """Blocking (reads files; a cold GGUF takes seconds): call it off the event loop."""
        files = resolve(spec)
        info = load_model_info(files)
        if info.context_length <= 0:
            raise ValueError(f"{spec}: the model's context length is unknown")
        template = None
        if info.chat_template:
            template = ChatTemplate(info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token)
        tokenizer = load_tokenizer(files)
        # DeepSeek-V4 checkpoints speak the V4 prompt format; every other model its own chat template.
        encoding: Encoding = "v4" if info.architecture.startswith("deepseek_v4") else "chat_template"
        return cls(info, tokenizer, TokenTable.from_tokenizer(tokenizer), template, encoding)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))
