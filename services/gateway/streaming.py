"""The per-request event pump: `events.<request_id>` in `seq` order.

The pump subscribes before the gateway asks the recipe to prepare the request, so no event can be missed, and
it buffers what arrives early: events may come out of order (seq 0, 1, 2, ... per request) and before the
PrepareReply itself. `Pumps` knows every open pump, so a stopping gateway can end them all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from shared import subjects
from shared.bus import Bus, Envelope, Subscription
from shared.schemas.gateway import ApiEvent, PrepareReply, PrepareRequest, Resume

if TYPE_CHECKING:
    from services.gateway.metrics import RequestMeter

log = logging.getLogger(__name__)


class Reorder:
    """Takes events in any order and hands them out in `seq` order (0, 1, 2, ...), each exactly once."""

    def __init__(self) -> None:
        self._next = 0
        self._held: dict[int, ApiEvent] = {}

    @property
    def held(self) -> int:
        return len(self._held)

    def push(self, event: ApiEvent) -> list[ApiEvent]:
        if event.seq < self._next or event.seq in self._held:
            return []  # a duplicate
        self._held[event.seq] = event
        ready = []
        while self._next in self._held:
            ready.append(self._held.pop(self._next))
            self._next += 1
        return ready


class PumpAborted(Exception):
    """The gateway ended the request itself (shutdown); `reason` goes into the Cancel message."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EventPump:
    """One request's events, and what the gateway holds of it should its recipe die: the recipe that took it
    (`accepted`), the engine tokens behind every event handed out, the latest migration: a Resume for another
    recipe. Events of an earlier recipe (`epoch`) are dropped once another took over."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._reorder = Reorder()
        self.prepare: PrepareRequest | None = None  # what the recipe was asked
        self.recipe = ""  # the boot of the recipe process that has the request ("" = none yet)
        self.accepted_at = 0.0  # monotonic time it took it
        self.seed = 0
        self.created = 0
        self.epoch = 0
        self.token_ids: list[int] = []
        self.cached_tokens = 0
        self.migration = 0
        self._ready: asyncio.Queue[ApiEvent | PumpAborted] = asyncio.Queue()
        self._aborted: PumpAborted | None = None
        self._sub: Subscription | None = None
        self.meter: RequestMeter | None = None  # set once the request is accepted: sees each event handed out
        self.losses = 0  # the bus's losses when this request last heard an event (or opened)
        self.last_event_at = time.monotonic()

    async def open(self, bus: Bus) -> None:
        self.losses = bus.losses
        self._sub = await bus.subscribe(subjects.events(self.request_id), ApiEvent, self._on_event)

    async def close(self) -> None:
        if self._sub is None:
            return
        sub, self._sub = self._sub, None
        try:
            await sub.unsubscribe()
        except Exception as exc:  # the connection is closing: the server drops the subscription anyway
            log.debug("unsubscribe %s: %s", self.request_id, exc)

    async def _on_event(self, event: ApiEvent, _: Envelope) -> None:
        if event.epoch != self.epoch:
            return  # from a recipe taken for dead (or one that took over before this pump knows)
        for ready in self._reorder.push(event):
            self.token_ids += ready.token_ids
            self.cached_tokens = max(self.cached_tokens, ready.cached_tokens)
            self.migration = max(self.migration, ready.migration)
            self._ready.put_nowait(ready)

    def accepted(self, reply: PrepareReply, now: float) -> None:
        """A recipe took the request (first, or over from a dead one)."""
        self.recipe, self.accepted_at = reply.recipe, now
        if self.epoch == 0:
            self.seed, self.created = reply.seed, reply.created

    def resume(self) -> Resume:
        """What the next recipe needs to go on; from now on only its events count (their seq starts again)."""
        self.epoch += 1
        self._reorder = Reorder()
        return Resume(self.seed, self.created, list(self.token_ids), self.cached_tokens, self.migration, self.epoch)

    def abort(self, reason: str) -> None:
        self._aborted = PumpAborted(reason)
        self._ready.put_nowait(self._aborted)  # wakes a waiting `next`

    async def next(self, timeout: float) -> ApiEvent:
        """The next event in order; TimeoutError after `timeout` s without one, PumpAborted once aborted."""
        if self._aborted is not None:
            raise self._aborted
        item = await asyncio.wait_for(self._ready.get(), timeout)
        if isinstance(item, PumpAborted):
            raise item
        if self.meter is not None:
            self.meter.event(item, time.monotonic())
        return item


class Pumps:
    """Every open pump of this gateway. `closing` makes new requests fail fast during shutdown."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._open: dict[str, EventPump] = {}
        self.closing = False

    def __len__(self) -> int:
        return len(self._open)

    @asynccontextmanager
    async def open(self, request_id: str) -> AsyncIterator[EventPump]:
        pump = EventPump(request_id)
        await pump.open(self._bus)
        self._open[request_id] = pump
        try:
            yield pump
        finally:
            self._open.pop(request_id, None)
            await pump.close()

    def abort_all(self, reason: str) -> None:
        self.closing = True
        for pump in self._open.values():
            pump.abort(reason)
