"""API request -> `PreparedRequest`: one converter per API, all producing the same conversation model.

    convert("chat", body, options)  ->  PreparedRequest  (or raises ConversionError: status + message)

`body` is the raw request (bytes / str) or an already parsed JSON object. Errors carry the reference's status
and message; `api_error` wraps one in the API's own error body for the client.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import orjson

from services.recipe.apis.errors import ApiError, error_for
from services.recipe.convert import fields
from services.recipe.convert.options import (
    DEEPSEEK_MODELS,
    DEFAULT_OPTIONS,
    ConversionError,
    ConvertOptions,
    Encoding,
    FieldRefusal,
)
from services.recipe.convert.serde import BodyError
from services.recipe.prepared import PreparedRequest
from shared.json_depth import depth_message, too_deep

Converter = Callable[[Any, ConvertOptions], PreparedRequest]


APIS = ("chat", "responses", "messages", "completions")
MAX_CACHE_SALT = 256  # vLLM's `cache_salt`: requests share cached prefixes only with the same salt (and tenant)


def _converter(api: str) -> Converter:
    # Imported on first use: the CLI converts one API per process and loads only that one.
    module = importlib.import_module(f"services.recipe.convert.{api}")
    return cast(Converter, module.convert)


def convert(api: str, body: bytes | str | Any, options: ConvertOptions = DEFAULT_OPTIONS) -> PreparedRequest:
    if api not in APIS:
        raise ValueError(f"unknown API {api!r}")
    if isinstance(body, (bytes, bytearray, memoryview, str)):
        try:
            body = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise ConversionError(f"invalid JSON request: {exc}") from None
    if too_deep(body):  # the gateway refuses these too; the recipe guards its own walks
        raise ConversionError(depth_message())
    try:
        prepared = _converter(api)(body, options)
    except BodyError as exc:
        raise ConversionError(f"invalid request body: {exc.message}") from None
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    if salt is not None:
        if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT:
            raise ConversionError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters")
        prepared = replace(prepared, cache_salt=salt)
    return fields.apply(prepared.api, body, prepared, options)  # after every check the reference makes


def api_error(api: str, error: ConversionError) -> ApiError:
    """The refusal in the API's own error format (OpenAI's for chat, completions and responses)."""
    param = error.field if isinstance(error, FieldRefusal) else None
    return error_for(api, error.status, error.message, code="invalid_request_error", param=param)


__all__ = [
    "APIS", "DEEPSEEK_MODELS", "ConversionError", "ConvertOptions", "Encoding", "FieldRefusal", "api_error",
    "convert",
]
