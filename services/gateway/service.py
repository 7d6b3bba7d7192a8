"""The gateway service: an aiohttp server on host:port, the HTTP front door of the mesh.

stop(): end every request in flight (each sends its Cancel and gets a 503 or a last error frame), then stop
the server, giving handlers `SHUTDOWN_GRACE_S` to finish writing.
"""

from __future__ import annotations

import logging

from aiohttp import web

from services.gateway.app import PUMPS, READINESS, build_app
from services.gateway.config import GatewayConfig
from services.gateway.protocol import ApiRunner
from services.gateway.routes.ops import Readiness
from services.gateway.streaming import Pumps
from shared.bus import Bus
from shared.models import ModelNotFound, resolve

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0


def served_models(spec: str) -> list[str]:
    """The model ids clients may ask for. The gateway never loads a model; resolving the name is cheap."""
    try:
        return [resolve(spec).name]
    except ModelNotFound as exc:  # the files may live only on the worker hosts
        log.warning("%s; serving it under the name %r", exc, spec)
        return [spec]


class GatewayService:
    name = "gateway"

    def __init__(self, config: GatewayConfig, models: list[str]) -> None:
        self._config = config
        self._models = models
        self._runner: web.AppRunner | None = None
        self._pumps: Pumps | None = None
        self._readiness: Readiness | None = None
        self.port = config.port  # the bound port once started (config.port may be 0)

    async def start(self, bus: Bus) -> None:
        app = build_app(bus, self._config, self._models)
        # handler_cancellation: a client that hangs up cancels its handler at once, which sends the Cancel.
        runner = ApiRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S,
                           keepalive_timeout=self._config.client_idle_timeout_s,
                           header_timeout_s=self._config.client_header_timeout_s)
        await runner.setup()
        await web.TCPSite(runner, self._config.host, self._config.port).start()
        self._runner, self._pumps, self._readiness = runner, app[PUMPS], app[READINESS]
        self.port = runner.addresses[0][1]
        log.info("gateway listening on http://%s:%d (models: %s)", self._config.host, self.port, self._models)

    async def stop(self) -> None:
        if self._runner is None or self._pumps is None:
            return
        self._pumps.abort_all("gateway shutting down")
        await self._runner.cleanup()
        self._runner = None

    def health(self) -> tuple[bool, str]:
        if self._runner is None or self._pumps is None:
            return False, "not listening"
        if self._pumps.closing:
            return False, "shutting down"
        # ready as /health is, so `deepinfer up` announces the mesh once requests can be served
        if self._readiness is not None and (missing := self._readiness.missing()):
            return False, f"listening on port {self.port}; waiting for " + ", ".join(missing)
        return True, f"listening on port {self.port}, {len(self._pumps)} requests in flight"
