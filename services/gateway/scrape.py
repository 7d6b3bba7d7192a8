"""Other services' statistics on the gateway's /metrics: a stats request on the bus at each scrape, the reply
kept and turned into metric families when the registry collects.

prometheus_client collects synchronously, so /metrics first awaits every `refresh()` (each bounded by its own
timeout; none answering is a valid state: its `<name>_up 0`), then renders the registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from prometheus_client.core import GaugeMetricFamily, Metric

from shared.bus import Bus

log = logging.getLogger(__name__)

R = TypeVar("R")

SCRAPE_TIMEOUT_S = 1.0


class Scraped(Generic[R]):
    def __init__(
        self,
        bus: Bus,
        subject: str,
        request: Any,
        reply_type: type[R],
        families: Callable[[R], Iterable[Metric]],
        up: tuple[str, str],  # the name and help of the gauge that says whether anyone answered
        timeout: float = SCRAPE_TIMEOUT_S,
    ) -> None:
        self._bus = bus
        self._subject = subject
        self._request = request
        self._type = reply_type
        self._families = families
        self._up = up
        self._timeout = timeout
        self.reply: R | None = None

    async def refresh(self) -> None:
        try:
            reply = await self._bus.request(self._subject, self._request, self._type, timeout=self._timeout)
        except Exception as exc:  # noqa: BLE001 - /metrics must answer however the bus or the service fails
            log.debug("%s not answered: %s", self._subject, exc)
            reply = None
        self.reply = reply if isinstance(reply, self._type) else None

    def collect(self) -> Iterator[Metric]:
        name, help_text = self._up
        up = GaugeMetricFamily(name, help_text)
        up.add_metric([], int(self.reply is not None))
        yield up
        if self.reply is not None:
            yield from self._families(self.reply)
