"""Error bodies in each API's own format, one definition for every service that answers clients.

OpenAI:    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
Anthropic: {"type": "error", "error": {"type": ..., "message": ...}}

Each SDK maps these to its usual exception types, so a client sees our errors as it sees the vendor's.
"""

from __future__ import annotations

import orjson

_OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
}

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def openai_error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str | None = None
) -> bytes:
    """`kind` replaces the `type` the status implies (OpenAI's rate limits say "requests" or "tokens")."""
    kind = kind or _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def anthropic_error_body(status: int, message: str) -> bytes:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def sse_error_frame(body: bytes, *, named: bool) -> bytes:
    """An error body as the last frame of a stream whose HTTP status is already sent. Anthropic Messages and
    OpenAI Responses streams name their events (`event: error`); Chat and Completions streams send bare data."""
    return (b"event: error\n" if named else b"") + b"data: " + body + b"\n\n"
