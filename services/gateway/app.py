"""The aiohttp application: routes and middleware over one bus, with the per-app state the service needs."""

from __future__ import annotations

import functools
import time

from aiohttp import web

from services.gateway import kv_metrics
from services.gateway.config import GatewayConfig
from services.gateway.metrics import Metrics
from services.gateway.middleware import edge_middleware
from services.gateway.routes import add_routes
from services.gateway.routes.count import CountTokensHandler
from services.gateway.routes.generate import GenerateHandler
from services.gateway.routes.models import ModelsHandler
from services.gateway.routes.ops import OpsHandler
from services.gateway.routes.query import RecipeQueries
from services.gateway.streaming import Pumps
from shared.bus import Bus

PUMPS = web.AppKey("pumps", Pumps)
METRICS = web.AppKey("metrics", Metrics)


def build_app(bus: Bus, config: GatewayConfig, models: list[str]) -> web.Application:
    pumps = Pumps(bus)
    metrics = Metrics()
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[edge_middleware(metrics, config.api_key)],
    )
    app[PUMPS] = pumps
    app[METRICS] = metrics
    generate = GenerateHandler(
        bus,
        pumps,
        metrics,
        prepare_timeout_s=config.request_timeout_s,
        event_timeout_s=config.event_timeout_s,
        max_body_bytes=config.max_body_bytes,
    )
    models_handler = ModelsHandler(models, created=int(time.time()), bus=bus)
    ops = OpsHandler(lambda: bus.connected, pumps, metrics, functools.partial(kv_metrics.scrape, bus))
    count = CountTokensHandler(bus, timeout_s=config.request_timeout_s, max_body_bytes=config.max_body_bytes)
    queries = RecipeQueries(bus, timeout_s=config.request_timeout_s, max_body_bytes=config.max_body_bytes)
    add_routes(app, generate, count, models_handler, ops, queries)
    return app
