"""API request -> `PreparedRequest`: one converter per API, all producing the same conversation model.

    convert("chat", body, options)  ->  PreparedRequest  (or raises ConversionError: status + message)

`body` is the raw request (bytes / str) or an already parsed JSON object. Errors carry the reference's status
and message; `services.recipe.errors.api_error` wraps one in the API's own error body for the client.

`CONVERTERS` is the registry: an API is served once it has an entry there (a loader of its module's `convert`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import orjson

from services.recipe.convert import fields, structured
from services.recipe.convert.options import DEEPSEEK_MODELS, DEFAULT_OPTIONS, ConvertOptions, Encoding
from services.recipe.errors import BodyError, ConversionError
from services.recipe.prepared import PreparedRequest
from shared.json_depth import depth_message, too_deep

Converter = Callable[[Any, ConvertOptions], PreparedRequest]


MAX_CACHE_SALT = 256  # vLLM's `cache_salt`: requests share cached prefixes only with the same salt (and tenant)


# Each loader imports its converter on first use: the CLI converts one API per process and loads only that one.
def _chat() -> Converter:
    from services.recipe.convert.chat import convert

    return convert


def _responses() -> Converter:
    from services.recipe.convert.responses import convert

    return convert


def _messages() -> Converter:
    from services.recipe.convert.messages import convert

    return convert


def _completions() -> Converter:
    from services.recipe.convert.completions import convert

    return convert


CONVERTERS: Mapping[str, Callable[[], Converter]] = MappingProxyType(
    {"chat": _chat, "responses": _responses, "messages": _messages, "completions": _completions}
)
APIS: tuple[str, ...] = tuple(CONVERTERS)


def convert(api: str, body: bytes | str | Any, options: ConvertOptions = DEFAULT_OPTIONS) -> PreparedRequest:
    loader = CONVERTERS.get(api)
    if loader is None:
        raise ValueError(f"unknown API {api!r}")
    if isinstance(body, (bytes, bytearray, memoryview, str)):
        try:
            body = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise ConversionError(f"invalid JSON request: {exc}") from None
    if too_deep(body):  # the gateway refuses these too; the recipe guards its own walks
        raise ConversionError(depth_message())
    try:
        prepared = loader()(body, options)
    except BodyError as exc:
        raise ConversionError(f"invalid request body: {exc.message}") from None
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    if salt is not None:
        if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT:
            raise ConversionError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters")
        prepared = replace(prepared, cache_salt=salt)
    prepared = fields.apply(prepared.api, body, prepared, options)  # after every check the reference makes
    return structured.apply(prepared.api, body, prepared)


__all__ = ["APIS", "CONVERTERS", "DEEPSEEK_MODELS", "ConvertOptions", "Encoding", "convert"]
