"""Gateway error bodies: each API's own shape, so the SDKs raise their usual exceptions."""

from __future__ import annotations

import orjson

from services.gateway.errors import ANTHROPIC, OPENAI, RESPONSES, ApiError
from services.gateway.routes.table import API_ROUTES, error_format
from services.recipe.emit.processor import OutputProcessor
from services.recipe.flight import Flight
from services.recipe.prepared import Api, InferenceSpec, ParsingSpec, PreparedRequest
from shared.schemas.generate import TokenEvent


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
    body = RESPONSES.body(ApiError(504, "slow"))
    assert body == OPENAI.body(ApiError(504, "slow"))  # Responses errors are OpenAI's; only the frame is named
    assert RESPONSES.frame(body) == b"event: error\ndata: " + body + b"\n\n"


def _recipe_stream_failure(api: Api, status: int, message: str) -> bytes:
    """The last frame the recipe writes when a streaming request of `api` fails."""
    prepared = PreparedRequest(api, "m", "v4", stream=True, include_usage=False, conversation=None,
                               inference=InferenceSpec(None, None, None), parsing=ParsingSpec())
    flight = Flight("rid", prepared, OutputProcessor(prepared, response_id="x"), now=0.0)
    (frame,) = flight.fail(status, message).frames
    return frame


def test_a_mesh_error_ends_the_flight_and_cancels_the_request_everywhere() -> None:
    prepared = PreparedRequest("chat", "m", "v4", stream=True, include_usage=False, conversation=None,
                               inference=InferenceSpec(None, None, None), parsing=ParsingSpec())
    flight = Flight("rid", prepared, OutputProcessor(prepared, response_id="x"), now=0.0)
    out = flight.on_event(TokenEvent("rid", 0, [], "error", error="worker lost", error_status=503), now=1.0)
    assert out is not None and out.done and out.status == 503 and out.cancel == "error"


def test_gateway_stream_errors_are_framed_as_the_recipe_frames_its_own() -> None:
    """Whoever ends a stream (the gateway on a timeout, the recipe on a mesh error), the client sees one shape."""
    for route in API_ROUTES:
        for status in (500, 503, 504):
            ours = route.errors.frame(route.errors.body(ApiError(status, "gone")))
            assert ours == _recipe_stream_failure(route.api, status, "gone"), route.path  # type: ignore[arg-type]


def test_each_path_errors_in_its_api_format() -> None:
    assert {r.api for r in API_ROUTES} == {"chat", "messages", "completions", "responses"}
    assert error_format("/v1/messages") is ANTHROPIC
    assert error_format("/v1/chat/completions") is OPENAI
    assert error_format("/v1/responses") is RESPONSES
    assert error_format("/v1/completions") is OPENAI
    assert error_format("/nowhere") is OPENAI
