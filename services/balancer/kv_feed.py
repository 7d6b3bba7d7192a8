"""Keeps the balancer's PrefixIndex in step with every KV source on the bus: events as they come, a snapshot
(paged, see shared/kv_events.py's publisher) whenever a source's events show a gap, and silent sources forgotten.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from services.balancer.prefix_index import PrefixIndex, Sync
from shared import subjects
from shared.bus import Bus, BusTimeout, Envelope, Subscription
from shared.kv_events import TICK_S
from shared.schemas.events import KvEvent, KvSnapshot, KvSnapshotRequest

log = logging.getLogger(__name__)


class SnapshotError(Exception):
    """A snapshot could not be fetched whole (it expired between pages, or the source restarted)."""


async def fetch_snapshot(bus: Bus, source: str, *, timeout: float = 5.0) -> KvSnapshot:
    """All pages of a new snapshot of `source`, joined."""
    subject = subjects.kv_snapshot(source)
    first = page = await bus.request(subject, KvSnapshotRequest(), KvSnapshot, timeout=timeout)
    hashes = {tier: list(h) for tier, h in first.hashes.items()}
    while not page.error and page.next_offset:
        request = KvSnapshotRequest(first.snapshot_id, page.next_offset)
        page = await bus.request(subject, request, KvSnapshot, timeout=timeout)
        if page.snapshot_id != first.snapshot_id or page.epoch != first.epoch:
            raise SnapshotError(f"{source}: snapshot changed between pages")
        for tier, h in page.hashes.items():
            hashes.setdefault(tier, []).extend(h)
    if page.error:
        raise SnapshotError(f"{source}: {page.error}")
    return replace(first, hashes=hashes, next_offset=0)


class KvEventFeed:
    """Keeps a PrefixIndex in step with every source on the bus: apply events, fetch a snapshot on a gap, forget
    sources that fell silent (no event or tick for `source_timeout_s`)."""

    def __init__(
        self,
        bus: Bus,
        index: PrefixIndex,
        *,
        source_timeout_s: float = 5 * TICK_S,
        snapshot_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.stats: Counter[str] = Counter()
        self._bus = bus
        self._source_timeout_s = source_timeout_s
        self._snapshot_timeout_s = snapshot_timeout_s
        self._clock = clock
        self._heard: dict[str, float] = {}
        self._fetching: dict[str, asyncio.Task[None]] = {}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self._bus.subscribe(subjects.KV_EVENTS_ALL, KvEvent, self._on_event)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        tasks = list(self._fetching.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def resync(self, source: str) -> None:
        """Fetch a snapshot of `source` unless one is already on its way."""
        if source not in self._fetching:
            self._fetching[source] = asyncio.create_task(self._fetch(source))

    def expire(self, now: float) -> list[str]:
        gone = [s for s, at in self._heard.items() if now - at > self._source_timeout_s]
        for source in gone:
            self.forget(source)
        return gone

    def forget(self, source: str) -> None:
        self._heard.pop(source, None)
        self.index.forget(source)

    async def _on_event(self, event: KvEvent, _: Envelope) -> None:
        self._heard[event.source] = self._clock()
        self.stats["events"] += 1
        if self.index.apply(event) is Sync.GAP and event.source not in self._fetching:
            self.stats["gaps"] += 1
            self.resync(event.source)

    async def _fetch(self, source: str) -> None:
        try:
            for _ in range(3):  # events lost while the snapshot was on its way: one more try at once
                snapshot = await fetch_snapshot(self._bus, source, timeout=self._snapshot_timeout_s)
                if self.index.load(snapshot) is Sync.OK:
                    self.stats["resyncs"] += 1
                    log.debug("%s: resynced at seq %d", source, snapshot.seq)
                    return
        except (BusTimeout, SnapshotError) as exc:  # the next event or tick tries again
            self.stats["resync_failures"] += 1
            log.info("no KV snapshot from %s: %s", source, exc)
        finally:
            self._fetching.pop(source, None)
