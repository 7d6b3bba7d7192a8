"""KV events, the publisher's side: a cache publishes its changes (EventPublisher) and answers snapshot requests.
The consumer, the balancer's prefix index with its feed and resync, is services/balancer/prefix_index.py and
services/balancer/kv_feed.py.

The protocol and wire types are in shared/schemas/events.py. The publisher's side, for a cache owned by one
thread that is not the event loop (the engine's thread, the kvcache I/O thread):

    owner thread   a change -> record(op, tier, hashes): buffered under a lock (same-kind changes merged)
    event loop     the flusher numbers what is buffered and publishes it in order; when idle, a tick per tick_s
    snapshot       fn() runs on the owner thread (`run`), under the lock: the hashes held and the last seq numbered

A change recorded before a snapshot but numbered after it is replayed by consumers on top of the snapshot, which
already reflects it: harmless, since ops set or clear one (hash, tier) and are applied in order.

Events travel on core NATS, not JetStream: a consumer that misses some (slow consumer, reconnect, restart) only
needs the current holdings, which a snapshot gives exactly; a replay log would still need a snapshot for what
happened before its retention, and would put storage and latency on every block a worker caches.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shared import subjects
from shared.bus import Bus, Subscription
from shared.schemas.events import (
    OP_REMOVED,
    OP_STORED,
    OP_TICK,
    KvEvent,
    KvSnapshot,
    KvSnapshotRequest,
)

log = logging.getLogger(__name__)

TICK_S = 2.0  # an idle source says its last seq this often: consumers notice a lost last event, or a new source
MAX_EVENT_HASHES = 4096  # per message: 4096 x 18 bytes of msgpack is well under NATS's 1 MiB
MAX_BUFFERED_HASHES = 1_000_000  # the bus cannot keep up: drop, skip a seq, consumers resync from a snapshot
SNAPSHOT_TTL_S = 30.0  # a snapshot's pages stay this long for a consumer to fetch them
MAX_SNAPSHOTS = 4

# what the owner thread's snapshot function returns: tier -> every hash held there
Holdings = Mapping[str, Iterable[bytes]]


@dataclass(frozen=True)
class _Taken:
    seq: int
    tiers: list[tuple[str, list[bytes]]]
    expires_at: float

    def page(self, offset: int, size: int) -> tuple[dict[str, list[bytes]], int]:
        """Hashes [offset, offset + size) counted over the tiers in order, and the next offset (0: none left)."""
        out: dict[str, list[bytes]] = {}
        start = 0
        for tier, hashes in self.tiers:
            lo, hi = max(offset - start, 0), min(offset + size - start, len(hashes))
            if lo < hi:
                out[tier] = hashes[lo:hi]
            start += len(hashes)
        return out, (offset + size if offset + size < start else 0)


class EventPublisher:
    """Publishes one source's changes on `kv.events.<source>` and answers `kv.snapshot.<source>`.

    Construct it on the event loop. `record` may be called from any thread; the snapshot function passed to
    `serve_snapshots` must run where the changes happen (pass `run`, e.g. `AsyncEngine.call`), so that no change
    lands between reading the holdings and reading the seq.
    """

    def __init__(
        self,
        bus: Bus,
        source: str,
        *,
        tick_s: float = TICK_S,
        max_event_hashes: int = MAX_EVENT_HASHES,
        max_buffered_hashes: int = MAX_BUFFERED_HASHES,
        page_hashes: int | None = None,
    ) -> None:
        if not source or any(c in source for c in " .*>"):
            raise ValueError(f"a KV event source must be one subject token, got {source!r}")
        self.source = source
        self.epoch = os.urandom(6).hex()
        self.stats: Counter[str] = Counter()
        self._bus = bus
        self._subject = subjects.kv_events(source)
        self._tick_s = tick_s
        self._max_event = max_event_hashes
        self._max_buffered = max_buffered_hashes
        # msgpack spends 2 bytes on a 16-byte hash; 40 leaves room for longer keys and the page's framing
        self._page = page_hashes or max(1, (bus.max_payload - 65536) // 40)
        self._lock = threading.RLock()  # re-entrant: a snapshot function may itself trigger record()
        self._buffer: list[tuple[str, str, list[bytes]]] = []  # (op, tier, hashes), not numbered yet
        self._buffered = 0
        self._seq = 0  # the last seq numbered (an overflow also uses one up, to make a gap)
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._snapshot_fn: Callable[[], Holdings] | None = None
        self._run_on: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None
        self._snapshots: OrderedDict[str, _Taken] = OrderedDict()
        self._sub: Subscription | None = None
        self._task = self._loop.create_task(self._flush_forever())

    def record(self, op: str, tier: str, hashes: Sequence[bytes]) -> None:
        """A change to this source's holdings (OP_STORED / OP_REMOVED), in the order it happened. Any thread."""
        assert op in (OP_STORED, OP_REMOVED), op
        if not hashes or self._closed:
            return
        with self._lock:
            was_empty = not self._buffer
            if self._buffered + len(hashes) > self._max_buffered:
                log.warning("%s: %d KV changes not published yet; dropping them", self.source, self._buffered)
                self._buffer.clear()
                self._buffered = 0
                self._seq += 1  # never published: every consumer sees a gap and fetches a snapshot
                self.stats["overflows"] += 1
            self._merge(op, tier, hashes)
            self._buffered += len(hashes)
        if was_empty:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the loop is closed: shutting down, nobody is listening
                pass

    def _merge(self, op: str, tier: str, hashes: Sequence[bytes]) -> None:
        # Only the order of changes to one tier matters (the index keeps each (hash, tier) apart), so a change
        # joins the latest buffered change to its tier when that one is of the same kind: a store writing RAM and
        # SSD in turn still sends two events per flush, not one per block.
        for entry in reversed(self._buffer):
            if entry[1] == tier:
                if entry[0] == op:
                    entry[2].extend(hashes)
                    return
                break
        self._buffer.append((op, tier, list(hashes)))

    # the kvcache store's Listener protocol (store.watch(publisher)): the same changes, named by tier first
    def stored(self, tier: str, hashes: Sequence[bytes]) -> None:
        self.record(OP_STORED, tier, hashes)

    def removed(self, tier: str, hashes: Sequence[bytes]) -> None:
        self.record(OP_REMOVED, tier, hashes)

    async def serve_snapshots(
        self, fn: Callable[[], Holdings], *, run: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None
    ) -> None:
        """Answer snapshot requests with `fn()` (tier -> hashes held), called through `run` when given."""
        self._snapshot_fn, self._run_on = fn, run
        self._sub = await self._bus.serve(subjects.kv_snapshot(self.source), KvSnapshotRequest, self._on_snapshot)

    async def close(self) -> None:
        """Publish what is buffered, then stop."""
        self._closed = True
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        for event in self._number():
            await self._send(event)
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    # --- internals ---------------------------------------------------------------------------------------------

    async def _flush_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._tick_s)
                woke = True
            except asyncio.TimeoutError:
                woke = False
            self._wake.clear()
            events = self._number()
            if not events and not woke:
                with self._lock:
                    events = [KvEvent(self.source, self.epoch, self._seq, OP_TICK)]
            for event in events:
                await self._send(event)

    def _number(self) -> list[KvEvent]:
        with self._lock:
            buffer, self._buffer, self._buffered = self._buffer, [], 0
            events = []
            for op, tier, hashes in buffer:
                for at in range(0, len(hashes), self._max_event):
                    self._seq += 1
                    part = hashes[at : at + self._max_event]
                    events.append(KvEvent(self.source, self.epoch, self._seq, op, tier, part))
            return events

    async def _send(self, event: KvEvent) -> None:
        try:
            await self._bus.publish(self._subject, event)
            self.stats["events"] += 1
        except Exception as exc:  # disconnected: consumers see the gap at the next event or tick and resync
            self.stats["lost"] += 1
            log.debug("%s: KV event %d not sent: %s", self.source, event.seq, exc)

    def _take(self) -> tuple[int, list[tuple[str, list[bytes]]]]:
        assert self._snapshot_fn is not None
        with self._lock:
            held = self._snapshot_fn()
            return self._seq, [(tier, list(hashes)) for tier, hashes in held.items()]

    async def _on_snapshot(self, req: KvSnapshotRequest) -> KvSnapshot:
        now = time.monotonic()
        for key in [k for k, t in self._snapshots.items() if t.expires_at <= now]:
            del self._snapshots[key]
        snapshot_id = req.snapshot_id
        if not snapshot_id:
            seq, tiers = await self._run_on(self._take) if self._run_on is not None else self._take()
            snapshot_id = os.urandom(6).hex()
            self._snapshots[snapshot_id] = _Taken(seq, tiers, now + SNAPSHOT_TTL_S)
            while len(self._snapshots) > MAX_SNAPSHOTS:
                self._snapshots.popitem(last=False)
            self.stats["snapshots"] += 1
        taken = self._snapshots.get(snapshot_id)
        if taken is None:
            return KvSnapshot(self.source, self.epoch, 0, snapshot_id, {}, error="snapshot expired: start again")
        hashes, next_offset = taken.page(req.offset, self._page)
        return KvSnapshot(self.source, self.epoch, taken.seq, snapshot_id, hashes, next_offset)
