"""Gateway error bodies: each API's own shape, so the SDKs raise their usual exceptions."""

from __future__ import annotations

import orjson

from services.gateway.errors import ANTHROPIC, OPENAI, ApiError
from services.gateway.routes.table import API_ROUTES, error_format


def test_openai_error_shape() -> None:
    body = orjson.loads(OPENAI.body(ApiError(400, "bad body")))
    assert body == {"error": {"message": "bad body", "type": "invalid_request_error", "param": None, "code": None}}
    body = orjson.loads(OPENAI.body(ApiError(401, "no key", code="invalid_api_key")))
    assert body["error"]["code"] == "invalid_api_key"
    assert orjson.loads(OPENAI.body(ApiError(503, "down")))["error"]["type"] == "server_error"


def test_anthropic_error_shape_and_types() -> None:
    body = orjson.loads(ANTHROPIC.body(ApiError(400, "bad body")))
    assert body == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad body"}}
    kinds = {s: orjson.loads(ANTHROPIC.body(ApiError(s, "x")))["error"]["type"] for s in (401, 404, 413, 500, 503, 504)}
    assert kinds == {
        401: "authentication_error",
        404: "not_found_error",
        413: "request_too_large",
        500: "api_error",
        503: "overloaded_error",
        504: "timeout_error",
    }


def test_error_frames() -> None:
    body = OPENAI.body(ApiError(504, "slow"))
    assert OPENAI.frame(body) == b"data: " + body + b"\n\n"
    body = ANTHROPIC.body(ApiError(504, "slow"))
    assert ANTHROPIC.frame(body) == b"event: error\ndata: " + body + b"\n\n"


def test_each_path_errors_in_its_api_format() -> None:
    assert {r.api for r in API_ROUTES} == {"chat", "messages", "completions", "responses"}
    assert error_format("/v1/messages") is ANTHROPIC
    assert error_format("/v1/chat/completions") is OPENAI
    assert error_format("/v1/responses") is OPENAI
    assert error_format("/nowhere") is OPENAI
