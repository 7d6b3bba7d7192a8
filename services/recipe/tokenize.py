"""vLLM's /tokenize and /detokenize, answered from the served model's own tokenizer and prompt format.

    {"model"?, "prompt", "add_special_tokens"?: true, "return_token_strs"?}            the text as it stands
    {"model"?, "messages", "add_generation_prompt"?: true, "continue_final_message"?,
     "add_special_tokens"?: false, "return_token_strs"?, "tools"?, ...}                 rendered as a chat request
      -> {"count", "max_model_len", "tokens"[, "token_strs"]}
    {"model"?, "tokens"} -> {"prompt"}

Chat messages go through the Chat Completions conversion and the same prompt format as a chat request (the
same fields: tools, thinking, reasoning_effort...), so `count` is the `prompt_tokens` that request reports (and
control tokens spelled in the messages are counted as text, as that request encodes them). A
prompt is encoded with the tokenizer's own post-processor (`add_special_tokens` adds what HF would add, e.g. a
Llama BOS), as vLLM does. A missing model means the first served one (vLLM's default model). Errors are
`ConversionError`s (the service wraps them in OpenAI's error body): an unknown model is vLLM's 404, anything
else malformed a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.recipe.convert import ConvertOptions, convert
from services.recipe.errors import ConversionError
from services.recipe.formats import chat_template, render
from services.recipe.model import ServedModel

# vLLM's TokenizeChatRequest fields that shape the tokenization, not the chat request rendered.
_TOKENIZE_ONLY = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "return_token_strs")
# vLLM fields we cannot honour: refused by name rather than silently ignored.
_REFUSED = ("chat_template", "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs")


def model_for(body: Mapping[str, Any], models: Mapping[str, ServedModel]) -> ServedModel:
    name = body.get("model")
    if name is None:
        return next(iter(models.values()))
    if not isinstance(name, str):
        raise ConversionError("'model' must be a string", 400)
    model = models.get(name)
    if model is None:
        raise ConversionError(f"The model `{name}` does not exist.", 404)
    return model


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConversionError(f"'{name}' must be a boolean", 400)
    return value


def tokenize(body: Mapping[str, Any], models: Mapping[str, ServedModel], options: ConvertOptions) -> dict[str, Any]:
    model = model_for(body, models)
    strs = _flag(body, "return_token_strs", False)
    if "prompt" in body:
        ids = _prompt_ids(body, model)
    elif "messages" in body:
        ids = _chat_ids(body, model, options)
    else:
        raise ConversionError("either 'prompt' or 'messages' is required", 400)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": model.context_length, "tokens": ids}
    if strs:
        tk = model.tokenizer.tk
        out["token_strs"] = [tk.id_to_token(i) or "" for i in ids]
    return out


def _prompt_ids(body: Mapping[str, Any], model: ServedModel) -> list[int]:
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise ConversionError("'prompt' must be a string", 400)
    special = _flag(body, "add_special_tokens", True)
    return list(model.tokenizer.tk.encode(prompt, add_special_tokens=special).ids)


def _chat_ids(body: Mapping[str, Any], model: ServedModel, options: ConvertOptions) -> list[int]:
    for name in _REFUSED:
        if body.get(name) is not None:
            raise ConversionError(f"'{name}' is not supported: prompts are rendered with the model's own format", 400)
    generation = _flag(body, "add_generation_prompt", True)
    continued = _flag(body, "continue_final_message", False)
    if generation and continued:  # vLLM's rule and message
        raise ConversionError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.", 400)
    chat = {k: v for k, v in body.items() if k not in _TOKENIZE_ONLY}
    chat["model"] = model.name
    messages = body["messages"]
    if continued:  # DeepSeek's prefix continuation is how a chat request continues its final assistant message
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict) \
                or messages[-1].get("role") != "assistant":
            raise ConversionError("continue_final_message needs a final assistant message", 400)
        chat["messages"] = [*messages[:-1], {**messages[-1], "prefix": True}]
    prepared = convert("chat", chat, options)
    if not generation and not continued:
        if prepared.encoding != "chat_template":  # a DeepSeek prompt always ends in the assistant's turn
            raise ConversionError("'add_generation_prompt': false is not supported for this model's format", 400)
        ids: list[int] | None = chat_template.encode(prepared.conversation, model, add_generation_prompt=False)[1]
    else:
        _, ids = render(prepared, model)
    if ids is None:
        raise ConversionError(f"model {model.name} has no tokenizer for its prompt format", 400)
    if _flag(body, "add_special_tokens", False):  # on top of the template's own: what the post-processor adds
        ids = [*model.tokenizer.tk.encode("", add_special_tokens=True).ids, *ids]
    return ids


def detokenize(body: Mapping[str, Any], models: Mapping[str, ServedModel]) -> dict[str, Any]:
    model = model_for(body, models)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise ConversionError("'tokens' must be a list of token ids", 400)
    vocab = model.tokenizer.vocab_size
    for i, token in enumerate(tokens):
        if not isinstance(token, int) or isinstance(token, bool):
            raise ConversionError(f"'tokens[{i}]' must be an integer token id", 400)
        if not 0 <= token < vocab:
            raise ConversionError(f"Token id {token} is out of vocabulary (the model has {vocab} tokens)", 400)
    return {"prompt": model.tokenizer.decode(tokens, skip_special=False)}
