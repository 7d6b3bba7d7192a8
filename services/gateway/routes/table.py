"""The APIs the gateway serves. Adding one is one line: its path, the `api` name the recipe dispatches on
(`PrepareRequest.api`), and the error format its SDKs expect."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.errors import ANTHROPIC, OPENAI, RESPONSES, ErrorFormat


@dataclass(frozen=True)
class ApiRoute:
    path: str
    api: str
    errors: ErrorFormat


API_ROUTES = (
    ApiRoute("/v1/chat/completions", "chat", OPENAI),
    ApiRoute("/v1/messages", "messages", ANTHROPIC),
    ApiRoute("/v1/completions", "completions", OPENAI),
    ApiRoute("/v1/responses", "responses", RESPONSES),
)

# Prompt-size questions answered by the recipe without generating: path -> the API whose request shape they take.
COUNT_ROUTES = (ApiRoute("/v1/messages/count_tokens", "messages", ANTHROPIC),)

# A stored response (GET, DELETE): answered by the recipe from its response store.
RESPONSE_BY_ID = "/v1/responses/{response_id}"

_BY_PATH = {route.path: route for route in (*API_ROUTES, *COUNT_ROUTES)}


def api_route(path: str) -> ApiRoute | None:
    return _BY_PATH.get(path)


def error_format(path: str) -> ErrorFormat:
    """Errors on any path come in the format of the API that owns it; OpenAI's for the rest (/v1/models, 404s)."""
    route = api_route(path)
    return route.errors if route is not None else OPENAI
