"""What conversion needs to know about the deployment: which model names are served with which prompt format
(the one place to configure it), and the reference's conversion switches."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, get_args

from services.recipe.errors import ConversionError

Encoding = Literal["v4", "v41", "chat_template"]

# Served model name -> prompt format. The DeepSeek names are the reference's; a deployment adds its own (e.g.
# "SmolLM2-135M-Instruct": "chat_template") with `ConvertOptions(models=...)`.
DEEPSEEK_MODELS: Mapping[str, Encoding] = MappingProxyType({"DeepSeek-V4-Pro": "v4", "DeepSeek-V4.1-Flash": "v41"})

MAX_TOKENS_UPPER_BOUND = 393_216  # the reference's default bound on a requested max_tokens


@dataclass(frozen=True)
class ConvertOptions:
    models: Mapping[str, Encoding] = field(default_factory=lambda: DEEPSEEK_MODELS)
    default_thinking: bool = True  # for DeepSeek formats; chat templates never think
    fill_missing_reasoning: bool = True  # thinking mode, history without reasoning: "" (else refuse the request)
    thinking_max_tokens_upper_bound: int = MAX_TOKENS_UPPER_BOUND
    non_thinking_max_tokens_upper_bound: int = MAX_TOKENS_UPPER_BOUND
    responses_web_search: Literal["drop", "reject"] = "drop"
    messages_web_search: Literal["drop", "reject"] = "reject"

    def __post_init__(self) -> None:
        bad = {name: enc for name, enc in self.models.items() if enc not in get_args(Encoding)}
        if bad:
            raise ValueError(f"unknown prompt formats: {bad}")

    def encoding(self, model: str) -> Encoding:
        enc = self.models.get(model)
        if enc is None:
            names = ", ".join(self.models)
            raise ConversionError(f"The supported API model names are {names}, but you passed {model}.")
        return enc

    def max_tokens_bound(self, thinking: bool) -> int:
        return self.thinking_max_tokens_upper_bound if thinking else self.non_thinking_max_tokens_upper_bound


DEFAULT_OPTIONS = ConvertOptions()
