"""OpenAI (legacy) Completions -> PreparedRequest. The reference has no Completions API; this follows OpenAI's
documented semantics, as vLLM serves them.

The prompt is raw: a string or token ids (one prompt: a string, [string], [ids] or [[ids]]), encoded without
any template and without thinking. OpenAI's defaults apply: max_tokens 16, at most 4 stop strings. Features
that would change the response's shape and that we do not serve (n > 1, best_of, echo, suffix) are refused;
vLLM's sampling fields and the other refusals are `convert/fields.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.recipe.conversation import Conversation
from services.recipe.convert import common
from services.recipe.convert.options import ConvertOptions
from services.recipe.convert.serde import (
    F32,
    Any_,
    Bool,
    Custom,
    Opt,
    Record,
    Str,
    UInt,
    is_int,
    json_field,
)
from services.recipe.errors import BodyError, ConversionError
from services.recipe.prepared import InferenceSpec, ParsingSpec, PreparedRequest

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_STOPS = 4
MAX_LOGPROBS = 5


def _prompt(value: Any) -> str | list[int]:
    """One prompt, as text or token ids."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if value and all(is_int(v) for v in value):
            return _token_ids(value)
        if len(value) == 1 and isinstance(value[0], str):
            return value[0]
        if len(value) == 1 and isinstance(value[0], list):
            return _token_ids(value[0])
        if len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
            raise BodyError("prompt: only one prompt per request is supported")
    raise BodyError("prompt: expected a string, an array of token ids, or an array with one of those")


def _token_ids(value: list[Any]) -> list[int]:
    if not value:
        raise BodyError("prompt: the token id array is empty")
    for v in value:
        if not is_int(v) or v < 0:
            raise BodyError(f"prompt: token ids must be non-negative integers, got {v!r}")
    return value


def _stop(value: Any) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise BodyError("stop: expected a string or an array of strings")
    return items


@dataclass(frozen=True)
class StreamOptions:
    include_usage: bool | None = json_field(Opt(Bool))


@dataclass(frozen=True)
class CompletionRequest:
    model: str = json_field(Str, required=True)
    prompt: str | list[int] = json_field(Custom(_prompt), required=True)
    max_tokens: int | None = json_field(Opt(UInt(32)))
    temperature: float | None = json_field(Opt(F32))
    top_p: float | None = json_field(Opt(F32))
    n: int | None = json_field(Opt(UInt(8)))
    best_of: int | None = json_field(Opt(UInt(8)))
    stream: bool | None = json_field(Opt(Bool))
    stream_options: StreamOptions | None = json_field(Opt(Record(StreamOptions)))
    stop: list[str] | None = json_field(Opt(Custom(_stop)))
    seed: int | None = json_field(Opt(UInt(64)))
    echo: bool | None = json_field(Opt(Bool))
    suffix: str | None = json_field(Opt(Str))
    logprobs: int | None = json_field(Opt(UInt(8)))
    presence_penalty: float | None = json_field(Opt(F32))
    frequency_penalty: float | None = json_field(Opt(F32))
    logit_bias: Any = json_field(Any_)
    user: str | None = json_field(Opt(Str))


REQUEST = Record(CompletionRequest)


def convert(body: Any, options: ConvertOptions) -> PreparedRequest:
    req = REQUEST.read(body)
    encoding = options.encoding(req.model)
    for key, allowed in (("n", 1), ("best_of", 1)):
        if getattr(req, key) is not None and getattr(req, key) != allowed:
            raise ConversionError(f"Invalid {key} value (currently only {key} = 1 is supported)")
    if req.echo:
        raise ConversionError("echo is not supported")
    if req.suffix:
        raise ConversionError("suffix is not supported")
    stop = req.stop or []
    if len(stop) > MAX_STOPS:
        raise ConversionError(f"Stop string array too long: {len(stop)}")
    stop = [s for s in stop if s]
    for name in ("presence_penalty", "frequency_penalty"):
        common.check_range(name, getattr(req, name), -2.0, 2.0, "[-2, 2]")
    common.check_range("temperature", req.temperature, 0.0, 2.0, "[0, 2]")
    common.check_top_p(req.top_p)
    if req.logprobs is not None and req.logprobs > MAX_LOGPROBS:
        raise ConversionError(f"Invalid logprobs value, the valid range of logprobs is [0, {MAX_LOGPROBS}]")
    common.check_max_tokens(req.max_tokens, options.max_tokens_bound(False))
    common.check_seed(req.seed)
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise ConversionError("stream_options should be set along with stream = true")
    prompt = req.prompt
    # Raw prompts are sampled as the client asked: no thinking-mode or tool rules apply.
    inference = InferenceSpec(
        max_tokens=DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
        logprobs=req.logprobs is not None, top_logprobs=req.logprobs,
    )
    return PreparedRequest(
        api="completions", model=req.model, encoding=encoding, stream=stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        conversation=Conversation((), thinking=False), inference=inference,
        parsing=ParsingSpec(parse_tool_calls=False, stop_sequences=stop),
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=None if isinstance(prompt, str) else list(prompt),
    )
