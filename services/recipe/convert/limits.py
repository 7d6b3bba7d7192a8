"""The prompt's limits once it is encoded: ids the model knows, not empty (as vLLM's input checks, with its
messages), and max_tokens: the reference's `ConversationRequest.resolve_max_tokens`.

    requested m:  prompt + m > context -> refused; else m
    unset:        prompt > context -> refused; else min(default, context - prompt), at least 1
                  default = 8,192 without thinking, 131,072 thinking at max effort, 65,536 thinking otherwise
"""

from __future__ import annotations

from services.recipe.errors import ConversionError
from services.recipe.prepared import PreparedRequest

DEFAULT_MAX_TOKENS = 8_192
THINKING_MAX_TOKENS = 65_536
MAX_EFFORT_MAX_TOKENS = 131_072


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """Client token ids (a Completions prompt) the model can embed; raises ConversionError (400). The engine
    refuses the others too, but only after the request was queued."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ConversionError(f"Token id {bad} is out of vocabulary (the model has {vocab_size} tokens)")


def check_prompt(ids: list[int]) -> None:
    if not ids:  # e.g. "prompt": "" on a model that adds no BOS
        raise ConversionError("The decoder prompt cannot be empty")


def default_max_tokens(prepared: PreparedRequest) -> int:
    conv = prepared.conversation
    if not conv.thinking:
        return DEFAULT_MAX_TOKENS
    return MAX_EFFORT_MAX_TOKENS if conv.reasoning_effort == "max" else THINKING_MAX_TOKENS


def resolve_max_tokens(prepared: PreparedRequest, prompt_tokens: int, context_limit: int) -> int:
    """The max_tokens to send to the engine; raises ConversionError (400) when the request cannot fit."""
    requested = prepared.inference.max_tokens
    if requested is not None:
        if prompt_tokens + requested > context_limit:
            raise _too_long(context_limit, prompt_tokens, requested)
        return requested
    if prompt_tokens > context_limit:
        raise _too_long(context_limit, prompt_tokens, 0)
    return max(1, min(default_max_tokens(prepared), context_limit - prompt_tokens))


def _too_long(context: int, prompt: int, completion: int) -> ConversionError:
    return ConversionError(
        f"This model's maximum context length is {context} tokens. However, you requested {prompt + completion} "
        f"tokens ({prompt} in the messages, {completion} in the completion). Please reduce the length of the "
        "messages or completion."
    )
