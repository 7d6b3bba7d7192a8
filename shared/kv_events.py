"""KV events: a cache publishes its changes (EventPublisher); a router keeps every source's holdings in a pure
index (PrefixIndex), fed over the bus and resynchronised from snapshots on gaps (KvEventFeed).

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
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from nats.aio.subscription import Subscription

from shared import subjects
from shared.bus import Bus, BusTimeout, Envelope
from shared.schemas.events import (
    OP_REMOVED,
    OP_STORED,
    OP_TICK,
    TIER_LOCAL,
    TIERS,
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
PENDING_EVENTS = 4096  # events a consumer keeps while its snapshot request is in flight (more: fetch again)

# what the owner thread's snapshot function returns: tier -> every hash held there
Holdings = Mapping[str, Iterable[bytes]]


# --- publisher ---------------------------------------------------------------------------------------------------


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


# --- the consumer's index (pure) ---------------------------------------------------------------------------------


class Sync(StrEnum):
    OK = "ok"  # the index is in step with the source
    GAP = "gap"  # it missed something (or never knew the source): fetch a snapshot and load() it


@dataclass(frozen=True)
class Run:
    """The leading blocks of a prompt a source holds: the tier each one would be read from, in order."""

    tiers: tuple[str, ...] = ()

    @property
    def blocks(self) -> int:
        return len(self.tiers)

    def by_tier(self, start: int = 0) -> dict[str, int]:
        """Blocks of the run from block `start` on, per tier."""
        return dict(Counter(self.tiers[start:]))


def _tier_rank(tier: str) -> tuple[int, str]:
    return (TIERS.index(tier), "") if tier in TIERS else (len(TIERS), tier)


class _Source:
    def __init__(self, max_pending: int) -> None:
        self.epoch = ""
        self.seq = 0
        self.synced = False
        self.held: dict[bytes, int] = {}  # hash -> bit mask of the tiers holding it
        self.bits: dict[str, int] = {}  # tier -> its bit
        self.pending: deque[KvEvent] = deque(maxlen=max_pending)  # heard while out of step
        self._best: dict[int, str] = {}  # bit mask -> the fastest tier in it

    def reset(self, epoch: str, seq: int, holdings: Mapping[str, Iterable[bytes]]) -> None:
        self.epoch, self.seq, self.synced = epoch, seq, True
        self.held.clear()
        self.pending.clear()
        for tier, hashes in holdings.items():
            self.change(OP_STORED, tier, hashes)

    def change(self, op: str, tier: str, hashes: Iterable[bytes]) -> None:
        bit = self.bits.get(tier)
        if bit is None:
            bit = self.bits[tier] = 1 << len(self.bits)
            self._best.clear()
        held = self.held
        if op == OP_STORED:
            for h in hashes:
                held[h] = held.get(h, 0) | bit
        else:
            for h in hashes:
                mask = held.get(h, 0) & ~bit
                if mask:
                    held[h] = mask
                else:
                    held.pop(h, None)

    def best(self, mask: int) -> str:
        tier = self._best.get(mask)
        if tier is None:
            tier = self._best[mask] = min((t for t, b in self.bits.items() if mask & b), key=_tier_rank)
        return tier

    def holdings(self) -> dict[str, set[bytes]]:
        out: dict[str, set[bytes]] = {}
        for h, mask in self.held.items():
            for tier, bit in self.bits.items():
                if mask & bit:
                    out.setdefault(tier, set()).add(h)
        return out


class PrefixIndex:
    """Every source's holdings as its events and snapshots describe them; no I/O.

    A source out of step (after a gap) keeps answering from what it last knew, which is nearly right, until a
    snapshot replaces it; the events heard meanwhile are kept and applied on top of the snapshot.
    """

    def __init__(self, max_pending: int = PENDING_EVENTS) -> None:
        self._sources: dict[str, _Source] = {}
        self._max_pending = max_pending

    def apply(self, event: KvEvent) -> Sync:
        src = self._sources.get(event.source)
        if src is None:
            src = self._sources[event.source] = _Source(self._max_pending)
        tick = event.op == OP_TICK
        if event.op not in (OP_STORED, OP_REMOVED, OP_TICK):
            src.synced = False  # a publisher this consumer does not understand: start over from a snapshot
            return Sync.GAP
        if src.synced and (event.epoch != src.epoch or event.seq > src.seq + (0 if tick else 1)):
            src.synced = False
        if not src.synced:
            if not tick:
                src.pending.append(event)
            return Sync.GAP
        if not tick and event.seq > src.seq:  # (an older one is already reflected)
            src.change(event.op, event.tier, event.hashes)
            src.seq = event.seq
        return Sync.OK

    def load(self, snapshot: KvSnapshot) -> Sync:
        """Replace a source's holdings with a whole snapshot, then apply the events heard after its seq."""
        src = self._sources.get(snapshot.source)
        if src is None:
            src = self._sources[snapshot.source] = _Source(self._max_pending)
        later = [e for e in src.pending if e.epoch == snapshot.epoch and e.seq > snapshot.seq]
        src.reset(snapshot.epoch, snapshot.seq, snapshot.hashes)
        for event in later:
            self.apply(event)
        return Sync.OK if src.synced else Sync.GAP

    def run(self, source: str, hashes: Sequence[bytes]) -> Run:
        """The longest leading run of `hashes` (a prompt's chained block hashes) that `source` holds."""
        src = self._sources.get(source)
        if src is None:
            return Run()
        tiers = []
        for h in hashes:
            mask = src.held.get(h)
            if not mask:
                break
            tiers.append(src.best(mask))
        return Run(tuple(tiers))

    def runs(self, hashes: Sequence[bytes]) -> dict[str, Run]:
        """`run` of every source that holds at least the first block."""
        out = {}
        for source in self._sources:
            run = self.run(source, hashes)
            if run.blocks:
                out[source] = run
        return out

    def store_sources(self) -> list[str]:
        """Sources that are shared stores (tiers other than an engine's local cache), by name."""
        return sorted(s for s, src in self._sources.items() if any(t != TIER_LOCAL for t in src.bits))

    def forget(self, source: str) -> None:
        self._sources.pop(source, None)

    def sources(self) -> list[str]:
        return sorted(self._sources)

    def synced(self, source: str) -> bool:
        src = self._sources.get(source)
        return src is not None and src.synced

    def seq(self, source: str) -> int:
        src = self._sources.get(source)
        return 0 if src is None else src.seq

    def holdings(self, source: str) -> dict[str, set[bytes]]:
        """tier -> hashes (for inspection and tests)."""
        src = self._sources.get(source)
        return {} if src is None else src.holdings()


# --- the consumer's I/O ------------------------------------------------------------------------------------------


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
