"""Each API's own error JSON. An `ApiError` is a refusal already formatted for the client that sent it."""

from __future__ import annotations

from shared.api_errors import anthropic_error_body, openai_error_body


class ApiError(Exception):
    def __init__(self, status: int, body: bytes, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.message = message


def openai_error(
    status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str | None = None
) -> ApiError:
    return ApiError(status, openai_error_body(status, message, param=param, code=code, kind=kind), message)


def anthropic_error(status: int, message: str) -> ApiError:
    return ApiError(status, anthropic_error_body(status, message), message)


def error_for(
    api: str, status: int, message: str, *, code: str | None = None, param: str | None = None,
    kind: str | None = None,
) -> ApiError:
    """An error in the API's own format: Anthropic's for Messages, OpenAI's for the rest (with the field at
    fault as `param`, where known, and `kind` as the `type` when given)."""
    if api == "messages":
        return anthropic_error(status, message)
    return openai_error(status, message, param=param, code=code, kind=kind)
