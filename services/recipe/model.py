"""One served model as the codec sees it: its tokenizer, context length and chat template; conversation -> ids."""

from __future__ import annotations

from dataclasses import dataclass

from services.recipe.apis.base import ChatRequest
from services.recipe.chat_template import ChatTemplate, TemplateError
from shared.model_info import ModelInfo, load_model_info
from shared.models import resolve
from shared.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class ServedModel:
    info: ModelInfo
    tokenizer: Tokenizer
    template: ChatTemplate | None

    @property
    def name(self) -> str:
        return self.info.name

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
        return cls(info, load_tokenizer(files), template)

    def render(self, req: ChatRequest) -> str:
        if req.prompt is not None:
            return req.prompt
        if self.template is None:
            raise TemplateError(f"model {self.name} has no chat template; use a completions endpoint")
        return self.template.render(req.messages, add_generation_prompt=True, continue_final_message=req.continue_final)

    def prompt_ids(self, req: ChatRequest) -> list[int]:
        return self.tokenizer.encode(self.render(req))
