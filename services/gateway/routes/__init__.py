"""The HTTP surface: the API routes of `table.API_ROUTES`, the model list, health and metrics, and vLLM's
auxiliary routes (/tokenize, /detokenize, /version, /ping) and stored responses (GET / DELETE
/v1/responses/{id})."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from services.gateway.routes.count import CountTokensHandler
from services.gateway.routes.generate import GenerateHandler
from services.gateway.routes.models import ModelsHandler
from services.gateway.routes.ops import OpsHandler
from services.gateway.routes.query import RecipeQueries
from services.gateway.routes.table import API_ROUTES, COUNT_ROUTES, RESPONSE_BY_ID, ApiRoute
from services.gateway.routes.version import version

Handler = GenerateHandler | CountTokensHandler


def _bind(handler: Handler, route: ApiRoute) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await handler.handle(request, route)

    return handle


def add_routes(
    app: web.Application, generate: GenerateHandler, count: CountTokensHandler, models: ModelsHandler, ops: OpsHandler,
    queries: RecipeQueries,
) -> None:
    for route in API_ROUTES:
        app.router.add_post(route.path, _bind(generate, route))
    for route in COUNT_ROUTES:
        app.router.add_post(route.path, _bind(count, route))
    app.router.add_get("/v1/models", models.list)
    app.router.add_get("/v1/models/{model_id:.+}", models.get)
    app.router.add_get("/live", ops.live)
    app.router.add_get("/health", ops.health)
    app.router.add_get("/metrics", ops.metrics)
    app.router.add_get(RESPONSE_BY_ID, queries.get_response)
    app.router.add_delete(RESPONSE_BY_ID, queries.delete_response)
    app.router.add_post("/tokenize", queries.tokenize)
    app.router.add_post("/detokenize", queries.detokenize)
    app.router.add_get("/version", version)
    for method in ("GET", "POST"):  # vLLM's /ping (SageMaker's health check) is its /health
        app.router.add_route(method, "/ping", ops.health)
