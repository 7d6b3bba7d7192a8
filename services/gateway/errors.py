"""Error bodies in each API's own format, so every SDK surfaces our errors as its usual exceptions.

OpenAI:    {"error": {"message": ..., "type": ..., "param": null, "code": ...}}
Anthropic: {"type": "error", "error": {"type": ..., "message": ...}}

A stream that has already started cannot change its HTTP status: the error goes out as one last SSE frame,
exactly as the recipe writes its own (`shared.api_errors.sse_error_frame`): bare `data:` on Chat and Completions
streams, `event: error` on Messages and Responses streams, whose events are all named.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from shared.api_errors import anthropic_error_body, openai_error_body, sse_error_frame


class ApiError(Exception):
    """Bad input or an unavailable mesh: answered with `status` and a body in the API's error format."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}  # e.g. Retry-After on a 503


class ErrorFormat(Protocol):
    def body(self, error: ApiError) -> bytes: ...

    def frame(self, body: bytes) -> bytes:
        """An SSE frame carrying an error body of this format."""
        ...


class OpenAIErrors:
    def body(self, error: ApiError) -> bytes:
        return openai_error_body(error.status, error.message, code=error.code)

    def frame(self, body: bytes) -> bytes:
        return sse_error_frame(body, named=False)


class ResponsesErrors(OpenAIErrors):
    """OpenAI's error body; on a stream, a named `event: error` frame like every other Responses event."""

    def frame(self, body: bytes) -> bytes:
        return sse_error_frame(body, named=True)


class AnthropicErrors:
    def body(self, error: ApiError) -> bytes:
        return anthropic_error_body(error.status, error.message)

    def frame(self, body: bytes) -> bytes:
        return sse_error_frame(body, named=True)


BUS_DOWN_RETRY_AFTER_S = 2  # a restarted bus server is found again within about this long (shared/bus.py)


def bus_down() -> ApiError:
    """A request that arrives while the gateway has no bus connection: it could reach no one, so a 503 at once
    rather than after the recipe's timeout."""
    return ApiError(503, "the gateway has no connection to the message bus right now; try again shortly",
                    headers={"Retry-After": str(BUS_DOWN_RETRY_AFTER_S)})


OPENAI = OpenAIErrors()
RESPONSES = ResponsesErrors()
ANTHROPIC = AnthropicErrors()


def json_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def error_response(errors: ErrorFormat, error: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(error.status, errors.body(error), {**error.headers, **(headers or {})} or None)
