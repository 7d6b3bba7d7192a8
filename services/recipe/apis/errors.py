"""Each API's own error JSON. An `ApiError` is a refusal already formatted for the client that sent it."""

from __future__ import annotations

import orjson


class ApiError(Exception):
    def __init__(self, status: int, body: bytes, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.message = message


class Invalid(ValueError):
    """Bad input found by API-neutral validation; the API turns it into its own 4xx error."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


_OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
}


def openai_error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return ApiError(status, orjson.dumps(body), message)


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


def anthropic_error(status: int, message: str) -> ApiError:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return ApiError(status, orjson.dumps(body), message)
