"""The aiohttp application: routes and middleware over one bus, with the per-app state the service needs."""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web

from services.gateway import balancer_metrics, kv_metrics, launcher_metrics
from services.gateway.config import GatewayConfig
from services.gateway.fleet import Fleet
from services.gateway.fleet_metrics import FleetCollector
from services.gateway.metrics import Metrics
from services.gateway.middleware import edge_middleware
from services.gateway.routes import add_routes
from services.gateway.routes.count import CountTokensHandler
from services.gateway.routes.generate import BODY_TIMEOUT, GenerateHandler
from services.gateway.routes.models import ModelsHandler
from services.gateway.routes.ops import OpsHandler, Readiness
from services.gateway.routes.query import RecipeQueries
from services.gateway.streaming import Pumps
from shared import subjects
from shared.bus import Bus, Envelope
from shared.schemas.health import Presence
from shared.schemas.workers import Heartbeat

PUMPS = web.AppKey("pumps", Pumps)
METRICS = web.AppKey("metrics", Metrics)
READINESS = web.AppKey("readiness", Readiness)


def build_app(
    bus: Bus, config: GatewayConfig, models: list[str], clock: Callable[[], float] = time.monotonic
) -> web.Application:
    pumps = Pumps(bus)
    metrics = Metrics()
    fleet = Fleet()
    readiness = Readiness(fleet, models, clock)
    scrapes = [kv_metrics.scraper(bus), balancer_metrics.scraper(bus), launcher_metrics.scraper(bus)]
    metrics.register([FleetCollector(fleet, models, clock), *scrapes])
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[edge_middleware(metrics, config.api_key)],
    )
    app[PUMPS] = pumps
    app[METRICS] = metrics
    app[READINESS] = readiness
    app[BODY_TIMEOUT] = config.client_body_timeout_s

    async def on_heartbeat(beat: Heartbeat, _: Envelope) -> None:
        fleet.heard_worker(beat, clock())

    async def on_presence(presence: Presence, _: Envelope) -> None:
        fleet.heard_service(presence, clock())

    async def listen(_: web.Application) -> None:
        await bus.subscribe(subjects.HEARTBEAT, Heartbeat, on_heartbeat)
        await bus.subscribe(subjects.PRESENCE, Presence, on_presence)

    app.on_startup.append(listen)
    generate = GenerateHandler(
        bus,
        pumps,
        metrics,
        prepare_timeout_s=config.request_timeout_s,
        event_timeout_s=config.event_timeout_s,
        max_body_bytes=config.max_body_bytes,
        fleet=fleet,
    )
    models_handler = ModelsHandler(models, created=int(time.time()), bus=bus)
    ops = OpsHandler(lambda: bus.connected, pumps, metrics, readiness, scrapes)
    count = CountTokensHandler(bus, timeout_s=config.request_timeout_s, max_body_bytes=config.max_body_bytes)
    queries = RecipeQueries(bus, timeout_s=config.request_timeout_s, max_body_bytes=config.max_body_bytes)
    add_routes(app, generate, count, models_handler, ops, queries)
    return app
