"""GET /live, GET /health and GET /metrics: what orchestrators, load balancers and Prometheus poll.

    /live     liveness: the process serves HTTP and holds its NATS connection (restart it when this fails)
    /health   readiness: /live, and every served model has a recipe, a balancer and at least one prefill and
              one decode worker that spoke within the timeout; else 503 with what is missing (send no traffic)
    /metrics  Prometheus text: the gateway's registry, after fetching the other services' statistics
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from services.gateway.errors import json_response
from services.gateway.fleet import Fleet
from services.gateway.metrics import Metrics
from services.gateway.scrape import Scraped
from services.gateway.streaming import Pumps


class Readiness:
    def __init__(self, fleet: Fleet, models: Sequence[str], clock: Callable[[], float] = time.monotonic) -> None:
        self._fleet = fleet
        self._models = list(models)
        self._clock = clock

    def missing(self) -> list[str]:
        return self._fleet.missing(self._models, self._clock())


class OpsHandler:
    def __init__(
        self,
        connected: Callable[[], bool],
        pumps: Pumps,
        metrics: Metrics,
        readiness: Readiness,
        scrapes: Sequence[Scraped] = (),  # other services' statistics, fetched at each /metrics
    ) -> None:
        self._connected = connected
        self._pumps = pumps
        self._metrics = metrics
        self._readiness = readiness
        self._scrapes = list(scrapes)

    def _down(self) -> web.Response | None:
        if self._pumps.closing:
            return json_response(503, orjson.dumps({"status": "shutting down"}))
        if not self._connected():
            return json_response(503, orjson.dumps({"status": "nats disconnected"}))
        return None

    async def live(self, request: web.Request) -> web.Response:
        return self._down() or json_response(200, orjson.dumps({"status": "ok"}))

    async def health(self, request: web.Request) -> web.Response:
        # Cheap on purpose (load balancers poll it): the heartbeats are already here, nothing is asked.
        if (down := self._down()) is not None:
            return down
        if missing := self._readiness.missing():
            return json_response(503, orjson.dumps({"status": "not ready", "missing": missing}))
        return json_response(200, orjson.dumps({"status": "ok"}))

    async def metrics(self, request: web.Request) -> web.Response:
        await asyncio.gather(*(s.refresh() for s in self._scrapes))
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
