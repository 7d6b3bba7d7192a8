"""What every HTTP request goes through: a server span, authentication, metrics, and errors in API format.

No request ever gets aiohttp's plain-text errors or a bare 500: typed errors (`ApiError`), aiohttp's own 4xx
(unknown path, wrong method, body too large) and unexpected exceptions all become the route's API error JSON.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from opentelemetry.trace import SpanKind

from services.gateway.auth import authorized, presented_key
from services.gateway.errors import ApiError, error_response
from services.gateway.metrics import Metrics
from services.gateway.routes.table import api_route, error_format
from shared import tracing

log = logging.getLogger(__name__)

# Polled by orchestrators, load balancers and Prometheus: background traffic, never a trace of its own.
UNTRACED_PATHS = frozenset({"/live", "/health", "/metrics", "/ping", "/version"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CLIENT_CLOSED = 499  # nginx's convention: the client left before its answer (nothing reaches it)


def edge_middleware(metrics: Metrics, api_key: str | None) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def edge(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = api_route(request.path) if request.method == "POST" else None
        resource = request.match_info.route.resource
        http_route = resource.canonical if resource is not None else "unmatched"
        if request.path in UNTRACED_PATHS:
            return await _answer(request, handler, api_key)
        with tracing.tracer().start_as_current_span(
            f"{request.method} {http_route}",
            context=tracing.extract(request.headers),  # a client's traceparent makes us part of its trace
            kind=SpanKind.SERVER,
            attributes={"http.method": request.method, "http.route": http_route},
        ) as span:
            if route is not None:
                metrics.started()
            status = CLIENT_CLOSED  # unless a response says otherwise: cancellation means the client left
            try:
                response = await _answer(request, handler, api_key)
                status = response.status
                return response
            finally:
                span.set_attribute("http.status_code", status)
                if route is not None:
                    metrics.finished(route.api, status)

    return edge


async def _answer(request: web.Request, handler: Handler, api_key: str | None) -> web.StreamResponse:
    errors = error_format(request.path)
    if request.path.startswith("/v1/") and not authorized(presented_key(request.headers), api_key):
        return error_response(errors, ApiError(401, "invalid or missing API key", code="invalid_api_key"))
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(errors, exc)
    except web.HTTPException as exc:  # aiohttp's own: 404 no route, 405 method, 413 body
        return error_response(errors, ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}"))
    except ConnectionResetError:
        return web.Response(status=CLIENT_CLOSED)  # writing it fails quietly; the access log and metrics see it
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(errors, ApiError(500, "internal error in the gateway"))
