"""Services other than workers announce themselves on `services.presence`, so the gateway knows a recipe for
each model (and a balancer) is there before it says it is ready. Workers do the same with their heartbeats."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence

from shared import subjects
from shared.bus import Bus
from shared.schemas.health import Presence

log = logging.getLogger(__name__)

PRESENCE_INTERVAL_S = 1.0  # as often as workers heartbeat
PRESENCE_TIMEOUT_S = 3.0  # silent this long: gone (the balancer's default --worker-timeout, for workers too)


async def announce_forever(
    bus: Bus, service: str, instance: str, models: Sequence[str] = (), interval: float = PRESENCE_INTERVAL_S,
    aliases: Mapping[str, str] | None = None, boot: str = "",
) -> None:
    while True:
        try:
            presence = Presence(service, instance, list(models), time.time(), dict(aliases or {}), boot)
            await bus.publish(subjects.PRESENCE, presence)
        except Exception as exc:  # reconnecting: the gateway sees a gap, as it would for a worker
            log.debug("presence not sent: %s", exc)
        await asyncio.sleep(interval)
