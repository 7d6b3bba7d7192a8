"""The one skeleton every service runs in: logging, tracing, bus, health, signals -> stop -> drain -> exit.

A service implements `Service`: `start(bus)` subscribes and spawns what it needs, `stop()` stops taking work and
frees what it holds, `health()` says whether it is ready (and what it is doing while not, e.g. loading a model).
Each instance answers `health.<service>.<instance>` with a `HealthReply`; the launcher polls those.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Protocol

from shared import subjects, tracing
from shared.bus import Bus
from shared.nats_urls import server_urls
from shared.config import ServiceConfig, add_common_args, common_config
from shared.logs import setup_logging
from shared.schemas.health import HealthReply, HealthRequest

log = logging.getLogger(__name__)


class Service(Protocol):
    name: str

    async def start(self, bus: Bus) -> None: ...

    async def stop(self) -> None: ...

    def health(self) -> tuple[bool, str]: ...


def health_subject(service: str, instance: str) -> str:
    return f"{subjects.health(service)}.{instance}"


async def serve_forever(service: Service, config: ServiceConfig) -> None:
    tracing.setup(service.name, config.instance)
    bus = await Bus.connect(config.nats_url, config.instance)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def on_health(_: HealthRequest) -> HealthReply:
        ready, detail = service.health()
        return HealthReply(service=service.name, instance=config.instance, ready=ready, detail=detail)

    await bus.serve(health_subject(service.name, config.instance), HealthRequest, on_health)
    await service.start(bus)
    log.info("%s started (nats %s)", config.instance, config.nats_url)
    await stop.wait()
    log.info("%s stopping", config.instance)
    await service.stop()
    await bus.drain()
    tracing.shutdown()


def main(
    service_name: str,
    build: Callable[[ServiceConfig, argparse.Namespace], Service],
    add_args: Callable[[argparse.ArgumentParser], None] | None = None,
    argv: list[str] | None = None,
) -> None:
    """Entry point for `python -m services.<name>`: parse flags, build the service, run until signalled."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{service_name}")
    add_common_args(parser, service_name)
    if add_args is not None:
        add_args(parser)
    args = parser.parse_args(argv)
    try:
        config = common_config(args)
        server_urls(config.nats_url)  # a comma-separated list: every member a URL
        service = build(config, args)
    except ValueError as exc:  # bad flags: a usage error, not a traceback
        parser.error(str(exc))
    setup_logging(service_name, config.instance, config.log_format)
    asyncio.run(serve_forever(service, config))
