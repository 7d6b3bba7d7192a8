"""Request fields beyond the reference's: the vLLM sampling extensions we honour, and the fields we refuse by
name rather than drop. `apply` runs on a request the API's converter has accepted, so every check the
reference makes comes first and a request it refuses is still refused in its words.

    honoured   chat: max_completion_tokens (the smaller of it and max_tokens), presence_penalty,
               frequency_penalty, logit_bias, top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
               return_tokens_as_token_ids (logprobs' tokens spelled `token_id:N`, as vLLM's);
               completions: the same but max_completion_tokens;  messages: top_k (Anthropic's own);
               responses: `include: ["message.output_text.logprobs"]` asks for logprobs (OpenAI's way; the
               reference reports them for `top_logprobs` alone, and so do we)
               (logprobs / top_logprobs themselves are the converters': the reference reads them)
    refused    a field of REFUSED[api] sent with a value that is not its neutral one (penalty 0,
               prompt_logprobs none are neutral): a 400 naming the field (FieldRefusal, the OpenAI error's `param`)
    harmless   everything else, read and ignored like the reference does (user, metadata, store,
               service_tier, stream_options.continuous_usage_stats) or unknown
    elsewhere  chat, responses: parallel_tool_calls false allows one call under the tool grammar
               (convert/structured.py; the Responses object reports the value)

Where the reference reads none of these (it ignores top_k, max_completion_tokens and the vLLM fields, and
serves logprobs, penalties and logit_bias to a backend that may honour them) each rule is a deviation, shown
against it in tests/oracle/test_input_oracle_fields.py. The penalties' range ([-2, 2]) is the reference's own
check, made by the API's converter before this runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from services.recipe.convert.options import ConvertOptions
from services.recipe.convert.serde import is_int, is_number, unexpected
from services.recipe.errors import FieldRefusal
from services.recipe.prepared import Api, PreparedRequest

INT32_LIMIT = 1 << 31  # top_k at or above the vocabulary is no filter: the bound only keeps ints int32
MAX_LOGIT_BIAS = 1024  # entries: ours (OpenAI's documented bound is on the values only); each one costs every step
_OPENAI_SAMPLING = ("presence_penalty", "frequency_penalty", "logit_bias")
_VLLM = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "return_tokens_as_token_ids")
HONOURED: dict[Api, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", *_OPENAI_SAMPLING, *_VLLM),
    "completions": (*_OPENAI_SAMPLING, *_VLLM),
    "messages": ("top_k",),
    "responses": (),
}


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise FieldRefusal(f"Invalid {name} value: expected a boolean, got {unexpected(value)}", name)
    return value


def _logit_bias(name: str, value: Any) -> dict[int, float]:
    """OpenAI's shape: an object from token ids (JSON keys, so strings of digits) to a bias in [-100, 100]. Whether
    each id is in the model's vocabulary is check_logit_bias's, once the model is known."""
    if not isinstance(value, dict):
        raise FieldRefusal(f"Invalid {name} value: expected an object mapping token ids to biases, got "
                           f"{unexpected(value)}", name)
    if len(value) > MAX_LOGIT_BIAS:
        raise FieldRefusal(f"Invalid {name} value: at most {MAX_LOGIT_BIAS} token ids, got {len(value)}", name)
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < INT32_LIMIT):
            raise FieldRefusal(f"Invalid {name} key {key!r}: expected a token id (a non-negative integer)", name)
        out[int(key)] = _number(name, bias, lambda x: -100.0 <= x <= 100.0, "[-100, 100]")
    return out


def _penalty(name: str, value: Any) -> float:
    """The converter has checked the range on the f32 value, as the reference does; a double just past the bound
    that rounds onto it is the bound."""
    return min(max(_number(name, value, lambda x: True, "[-2, 2]"), -2.0), 2.0)


# A sampling extension's name (also its InferenceSpec field) -> its reader: the value checked, as the engine takes it.
EXTENSIONS: dict[str, Callable[[str, Any], Any]] = {
    "presence_penalty": _penalty,
    "frequency_penalty": _penalty,
    "logit_bias": _logit_bias,
    "top_k": lambda n, v: max(_int(n, v, -1, INT32_LIMIT - 1, "-1 or 0 (no limit) or a positive integer"), 0),
    "min_p": lambda n, v: _number(n, v, lambda x: 0.0 <= x <= 1.0, "[0, 1]"),
    "repetition_penalty": lambda n, v: _number(n, v, lambda x: x > 0.0, "(0, inf), 1 = off"),
    "min_tokens": lambda n, v: _int(n, v, 0, INT32_LIMIT - 1, "[0, max_tokens]"),
    "ignore_eos": _bool,
    "return_tokens_as_token_ids": _bool,
}


def apply(api: Api, body: Any, prepared: PreparedRequest, options: ConvertOptions) -> PreparedRequest:
    """`prepared` with the honoured extensions of `body`; FieldRefusal for a bad or refused field."""
    if not isinstance(body, dict):  # serde's array form of the body names no fields
        return prepared
    inference = prepared.inference
    changes: dict[str, Any] = {}
    for name in HONOURED[api]:
        value = body.get(name)
        if value is None:
            continue
        if name == "max_completion_tokens":  # OpenAI's newer name for max_tokens: the smaller one wins
            bound = options.max_tokens_bound(prepared.conversation.thinking)
            limit = _int(name, value, 1, bound, f"[1, {bound}]")
            changes["max_tokens"] = limit if inference.max_tokens is None else min(inference.max_tokens, limit)
        else:
            changes[name] = EXTENSIONS[name](name, value)
    max_tokens = changes.get("max_tokens", inference.max_tokens)
    if max_tokens is not None and changes.get("min_tokens", 0) > max_tokens:
        raise FieldRefusal(f"min_tokens ({changes['min_tokens']}) must be at most max_tokens ({max_tokens})",
                           "min_tokens")
    if api == "responses" and not inference.logprobs and _asks_logprobs(body.get("include")):
        changes["logprobs"] = True  # no top_logprobs: the sampled tokens' alone
    refuse(api, body)
    return replace(prepared, inference=replace(inference, **changes)) if changes else prepared


def check_min_tokens(prepared: PreparedRequest, max_tokens: int) -> None:
    """Once max_tokens is resolved (a default one is known only with the prompt's length)."""
    if prepared.inference.min_tokens > max_tokens:
        raise FieldRefusal(
            f"min_tokens ({prepared.inference.min_tokens}) must be at most max_tokens ({max_tokens}, the room the "
            "prompt leaves)", "min_tokens",
        )


def check_logit_bias(prepared: PreparedRequest, vocab_size: int) -> None:
    """Once the model is known: every biased id must be one of its tokens."""
    bad = next((t for t in prepared.inference.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise FieldRefusal(f"Invalid logit_bias key '{bad}': token id out of vocabulary (the model has "
                           f"{vocab_size} tokens)", "logit_bias")


def _int(name: str, value: Any, lo: int, hi: int, shown: str) -> int:
    if not is_int(value) or not lo <= value <= hi:
        raise FieldRefusal(f"Invalid {name} value, the valid range of {name} is {shown}", name)
    return value


def _number(name: str, value: Any, valid: Callable[[float], bool], shown: str) -> float:
    if not is_number(value) or math.isnan(value) or math.isinf(value) or not valid(float(value)):
        raise FieldRefusal(f"Invalid {name} value, the valid range of {name} is {shown}", name)
    return float(value)


# --- refused fields -------------------------------------------------------------------------------------------

Neutral = Callable[[Any], bool]


def _none(v: Any) -> bool:
    return v is None


def _false(v: Any) -> bool:
    return v is None or v is False


def _true(v: Any) -> bool:
    return v is None or v is True


def _zero(v: Any) -> bool:
    return v is None or (is_number(v) and v == 0)


def _one(v: Any) -> bool:
    return v is None or (is_number(v) and v == 1)


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


def _text_modality(v: Any) -> bool:
    return v is None or v == ["text"]


def _asks_logprobs(include: Any) -> bool:
    return isinstance(include, list) and "message.output_text.logprobs" in include


LOGPROBS = "the prompt's log probabilities are not reported (the output's are: logprobs)"

# Field -> (its neutral values, why it is refused otherwise). Sampling and output fields of OpenAI's APIs and of
# vLLM's extensions that would change the answer if they were honoured.
_OPENAI: dict[str, tuple[Neutral, str]] = {
    "use_beam_search": (_false, "beam search is not served"),
    "length_penalty": (_one, "beam search is not served"),
    "stop_token_ids": (_empty, "stop on strings with `stop` instead"),
    "include_stop_str_in_output": (_false, "stop strings are never included"),
    "skip_special_tokens": (_true, "special tokens are always skipped"),
    "spaces_between_special_tokens": (_true, "special tokens are always skipped"),
    "allowed_token_ids": (_empty, "token filters are not applied"),
    "bad_words": (_empty, "token filters are not applied"),
    "prompt_logprobs": (_none, LOGPROBS),
    "truncate_prompt_tokens": (_none, "prompts are never truncated; a prompt too long is refused"),
    "logits_processors": (_none, "custom logits processors are not served"),
}
REFUSED: dict[Api, dict[str, tuple[Neutral, str]]] = {
    "chat": {
        **_OPENAI,
        "audio": (_none, "audio output is not served"),
        "modalities": (_text_modality, "only text output is served"),
        "prediction": (_none, "predicted outputs are not served"),
        "functions": (_empty, "use `tools`"),
        "function_call": (_none, "use `tool_choice`"),
        "web_search_options": (_none, "server tools are not served"),
        "echo": (_false, "the last message is never echoed"),
        "continue_final_message": (_false, 'continue a final assistant message with "prefix": true on it'),
        "add_generation_prompt": (_true, 'continue a final assistant message with "prefix": true on it'),
        "chat_template": (_none, "the model's own chat template is always used"),
        "chat_template_kwargs": (_empty, "the model's own chat template is always used"),
        "documents": (_none, "documents are not passed to chat templates"),
    },
    "completions": {
        **_OPENAI,
        "response_format": (_none, "use structured_outputs (vLLM's) for a constrained completion"),
        "prompt_embeds": (_none, "prompt embeddings are not served"),
    },
    "messages": {
        "mcp_servers": (_empty, "server tools are not served"),
        "container": (_none, "server tools are not served"),
    },
    "responses": {
        "background": (_false, "background responses are not served"),
        "conversation": (_none, "stored conversations are not served"),
        "prompt": (_none, "stored prompt templates are not served"),
    },
}


def refuse(api: Api, body: dict[str, Any]) -> None:
    for name, (neutral, why) in REFUSED[api].items():
        if name in body and not neutral(body[name]):
            raise FieldRefusal(f"{name} is not supported: {why}", name)
