"""GET /health and GET /metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from services.gateway.errors import json_response
from services.gateway.metrics import Metrics
from services.gateway.streaming import Pumps

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class OpsHandler:
    def __init__(
        self,
        connected: Callable[[], bool],
        pumps: Pumps,
        metrics: Metrics,
        more_metrics: Callable[[], Awaitable[str]] | None = None,  # other services' series (e.g. the kvcache's)
    ) -> None:
        self._connected = connected
        self._pumps = pumps
        self._metrics = metrics
        self._more_metrics = more_metrics

    async def health(self, request: web.Request) -> web.Response:
        # Cheap on purpose: load balancers poll it. Whether a recipe answers shows up as 503s on real requests.
        if self._pumps.closing:
            return json_response(503, orjson.dumps({"status": "shutting down"}))
        if not self._connected():
            return json_response(503, orjson.dumps({"status": "nats disconnected"}))
        return json_response(200, orjson.dumps({"status": "ok"}))

    async def metrics(self, request: web.Request) -> web.Response:
        text = self._metrics.render()
        if self._more_metrics is not None:
            text += await self._more_metrics()
        return web.Response(body=text.encode(), headers={"Content-Type": PROMETHEUS_TYPE})
