"""Client side of the kvcache service, used by prefill and decode workers.

The store is an optimisation, never a dependency: every call degrades to "not cached" when the kvcache service
is slow or gone, and the worker recomputes.

Bulk moves in batches: a run of blocks is put as `kv.put.batch` messages and read back as `kv.get.run` messages,
each carrying as many blocks as fit `message_bytes`, with at most `window_bytes` of them in flight, answered in
order. The bound is what keeps the mesh alive: nats-server lets one connection have 32 MiB pending (4 x the
payload limit), and a burst past it (one request per block, all at once) gets the kvcache service cut off as a
slow consumer.

With an `Arena` (shared/kv_arena.py: the worker and the store on one host) the same batches carry only keys and
lengths; the bytes go through shared memory. The first reply that says the store cannot map the arena (another
host) turns it off for good, and the bytes go over NATS again.

Where the store keeps its RAM tier in a shared heap (shared/kv_heap.py), a get through the arena first asks
where the run lies in it (`kv.get.heap`): the store answers with descriptors under a read lease, this client
maps the heap read-only once (again when the store restarted: a new file, a new token) and returns views of
it, read-locked until the last is dropped; then it releases the lease. The store copies nothing; the engine
imports from the heap as from an arena slot. What the heap lacks, or anything wrong on the way (a token that
does not match, a lease that ended before the views were locked), is read the arena's way.

One copy each way through the arena: `put_run` has the engine export a run's blocks straight into arena slots
(no `bytes` per block), and `get_run` hands back views of the slots the store wrote into, which the engine
imports from; a slot lent to views comes back when the last of them is gone. Views are lent while more than a
window's worth of slots stays free; past that a chunk is copied out and its slot given back at once, so a run
bigger than the arena, or requests that keep their views long, slow the path down (two copies) but never stall it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import struct
import time
import traceback
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar, Union

from shared import subjects
from shared.bus import Bus, BusTimeout
from shared.kv_arena import ARENA_MIB, Arena, arena_path, remove_stale
from shared.kv_heap import HeapMap
from shared.schemas.kv import (
    KvGet,
    KvGetReply,
    KvGetRun,
    KvGetRunReply,
    KvGetHeap,
    KvGetRunShm,
    KvHeapRelease,
    KvHeapReply,
    KvLookup,
    KvLookupReply,
    KvPutBatch,
    KvPutBatchReply,
    KvPutShm,
    KvShmReply,
    KvStats,
    KvStatsReply,
)

log = logging.getLogger(__name__)

R = TypeVar("R")
Blob = Union[bytes, memoryview]  # a get's blob: bytes, or a view of the arena (shared/kv_arena.py `lend`)
# fills blocks [lo, hi) of a run into `out`, a writable buffer of (hi - lo) block sizes, for each (lo, hi, out);
# one call for a whole round of slots (it runs on the engine thread, between two steps)
Exporter = Callable[[list[tuple[int, int, memoryview]]], Awaitable[None]]

SHORT_TERM_TTL_S = 180.0
_PART_COUNT = struct.Struct("<I")  # a state's first part starts with how many parts there are
MESSAGE_OVERHEAD = 64 * 1024  # keys, msgpack framing and trace headers around a batch's blobs
MiB = 1 << 20


def _no_arena(instance: str, slots: int, slot_bytes: int) -> Arena | None:
    return None


def _shm_arena(instance: str, slots: int, slot_bytes: int) -> Arena | None:
    remove_stale(instance)  # what a crashed predecessor left in /dev/shm
    return Arena(arena_path(instance), slots, slot_bytes)


# How KV bytes travel, by name (--kv-transport). An RDMA library (NIXL, Mooncake's transfer engine) or CUDA IPC
# would be one more entry: a factory for an object with the Arena's take / give / lose / view / write / read /
# lend, where installed (see .notes/i11-arena.md for the CUDA IPC design).
TRANSPORTS: dict[str, Callable[[str, int, int], Arena | None]] = {"nats": _no_arena, "shm": _shm_arena}


def open_client(bus: Bus, transport: str, instance: str, *, message_bytes: int = 4 * MiB,
                window_bytes: int = 8 * MiB, arena_bytes: int = ARENA_MIB * MiB) -> KvClient:
    """A worker's client, its bytes over `transport` (a key of TRANSPORTS). arena_bytes: the shared memory a
    worker may fill (tmpfs pages, resident once touched): a run up to about this size imports with one copy."""
    message_bytes = min(message_bytes, bus.max_payload - MESSAGE_OVERHEAD)
    slots = max(window_bytes // message_bytes + 1, arena_bytes // message_bytes)
    arena = TRANSPORTS[transport](instance, slots, message_bytes)
    return KvClient(bus, message_bytes=message_bytes, window_bytes=window_bytes, arena=arena)


class KvClient:
    def __init__(self, bus: Bus, timeout: float = 5.0, *, message_bytes: int = 4 * MiB, window_bytes: int = 8 * MiB,
                 arena: Arena | None = None, heap: bool = True) -> None:
        """message_bytes: blobs per batch message, in bytes (a bigger blob goes alone); window_bytes: batches in
        flight at once, in bytes (at least one): keep it well under the server's 32 MiB per connection, for
        several workers may write to one kvcache instance at once. arena: move the bytes through it (its slots
        should be `message_bytes` and number window_bytes // message_bytes + 1); heap: with an arena, read the
        store's RAM hits from its shared heap by descriptor where it has one."""
        self._bus = bus
        self._timeout = timeout
        self._message_bytes = min(message_bytes, bus.max_payload - MESSAGE_OVERHEAD)
        self._window_bytes = window_bytes
        self._reserve = window_bytes // self._message_bytes + 1  # slots kept from views: the window's own
        self.arena = arena
        self.heap_on = heap  # turned off for good when the store says it has no heap for this client
        self.heap: HeapMap | None = None  # the store's heap, mapped on the first reply that names it
        self.on_heap: Callable[[HeapMap], object] | None = None  # called with each new map (a GPU worker pins it)
        # what this worker saw of the store, for its health report: blocks put / not stored, gets that failed
        self.counts: Counter[str] = Counter()

    async def lookup(self, hashes: list[bytes]) -> int:
        """Length of the longest stored prefix run of `hashes` (0 when the store is unreachable)."""
        return (await self.lookup_run(hashes)).hits

    async def lookup_run(self, hashes: list[bytes], lease_s: float = 0.0) -> KvLookupReply:
        """The stored prefix run of `hashes` and how it splits over the store's tiers; with `lease_s` > 0 the run
        is kept from eviction that long (capped by the service), so the gets that follow find it. A miss
        (hits 0) when the store is unreachable."""
        if not hashes:
            return KvLookupReply(hits=0)
        try:
            return await self._bus.request(
                subjects.KV_LOOKUP, KvLookup(hashes, lease_s), KvLookupReply, timeout=self._timeout
            )
        except BusTimeout as exc:
            log.warning("kv lookup failed, recomputing: %s", exc)
            self.counts["lookups_failed"] += 1
            return KvLookupReply(hits=0)

    async def stats(self) -> KvStatsReply | None:
        """One kvcache instance's tier counters, or None when none answers."""
        try:
            return await self._bus.request(subjects.KV_STATS, KvStats(), KvStatsReply, timeout=self._timeout)
        except BusTimeout:
            return None

    async def get_run(self, keys: Sequence[bytes]) -> list[Blob]:
        """The blobs of `keys` up to (not including) the first one missing. The first message asks for the whole
        run and learns how many blobs one reply carries; the rest go as that many keys a message, pipelined.
        Through the arena, blobs may be read-only views of it (see the module's doc): drop them once used."""
        run: list[Blob] = []
        try:
            await self._read_run(keys, run)
        except BaseException as exc:  # cancelled: the views must not live on in the traceback's frames
            run.clear()
            traceback.clear_frames(exc.__traceback__)
            raise
        self.counts["blocks_got"] += len(run)
        return run

    async def _read_run(self, keys: Sequence[bytes], run: list[Blob]) -> None:
        if self.arena is not None and self.heap_on:
            leased = await self._get_heap(self.arena, keys)
            if leased is None:
                return  # the store did not answer: a miss, within one timeout
            run += leased
        while len(run) < len(keys):
            rest = keys[len(run) :]
            first = await self._get_chunk(rest)
            if first is None or not first.blobs:
                break
            run += first.blobs
            if first.ended:
                break
            per = len(first.blobs)
            chunks = [rest[at : at + per] for at in range(per, len(rest), per)]
            calls = [(self._message_bytes, functools.partial(self._get_chunk, chunk)) for chunk in chunks]
            done = False
            async with contextlib.aclosing(self._ordered(calls)) as replies:
                i = 0
                async for reply in replies:
                    if reply is None or reply.ended:
                        run += reply.blobs if reply is not None else []
                        done = True
                        break
                    run += reply.blobs
                    if len(reply.blobs) < len(chunks[i]):
                        break  # that reply filled up early (bigger blobs): ask again from where it stopped
                    i += 1
            if done:
                break

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Each key's blob, or None where absent (or the store is unreachable): one request for all of them,
        for small entries (the reply must fit one message)."""
        if not keys:
            return []
        try:
            reply = await self._bus.request(subjects.KV_GET, KvGet(keys), KvGetReply, timeout=self._timeout)
        except BusTimeout as exc:
            log.warning("kv get failed: %s", exc)
            self.counts["gets_failed"] += 1
            return [None] * len(keys)
        return [*reply.blobs, *[None] * (len(keys) - len(reply.blobs))][: len(keys)]

    async def put_many(self, items: list[tuple[bytes, bytes]], ttl_s: float = 0.0) -> bool:
        """Store (key, blob) pairs; True when all were stored."""
        batches = self._batches(items)
        calls = [(sum(len(b) for _, b in batch), functools.partial(self._put_batch, batch, ttl_s)) for batch in batches]
        stored = 0
        async with contextlib.aclosing(self._ordered(calls)) as replies:
            async for n in replies:
                stored += n
        self.counts["blocks_put"] += stored
        self.counts["puts_failed"] += len(items) - stored
        return stored == len(items)

    async def put_run(self, keys: Sequence[bytes], export: Exporter, block_bytes: int, ttl_s: float = 0.0) -> bool:
        """Store a run of equal-sized blocks under `keys`, their bytes written by `export` (see Exporter): through
        the arena in rounds of as many slots as are free, each filled by one export call, so a block's bytes are
        copied once on their way in; over NATS in windows of `window_bytes`. True when all were stored."""
        per = max(1, self._message_bytes // block_bytes)  # blocks per batch (one slot, one message)
        batches = [(lo, min(lo + per, len(keys))) for lo in range(0, len(keys), per)]
        stored = at = 0
        while at < len(batches):
            arena = self.arena
            offsets = self._take(arena, len(batches) - at) if arena and per * block_bytes <= arena.slot_bytes else []
            if arena is not None and offsets:
                todo, at = batches[at : at + len(offsets)], at + len(offsets)
                stored += await self._put_round(arena, offsets, todo, keys, export, block_bytes, ttl_s)
                continue
            window = max(1, self._window_bytes // (per * block_bytes))
            todo, at = batches[at : at + window], at + window
            stored += await self._put_window(todo, keys, export, block_bytes, ttl_s)
        self.counts["blocks_put"] += stored
        self.counts["puts_failed"] += len(keys) - stored
        return stored == len(keys)

    # --- internals ---------------------------------------------------------------------------------------------

    @staticmethod
    def _take(arena: Arena, most: int) -> list[int]:
        offsets: list[int] = []
        while len(offsets) < most and (offset := arena.take()) is not None:
            offsets.append(offset)
        return offsets

    async def _put_round(self, arena: Arena, offsets: list[int], todo: list[tuple[int, int]], keys: Sequence[bytes],
                         export: Exporter, block_bytes: int, ttl_s: float) -> int:
        """One round through the arena: export into the slots at `offsets`, then one request per slot, all at once
        (only keys and lengths cross NATS). A slot whose request failed is settled by `_shm_request`."""
        parts = [(lo, hi, arena.view(offset, (hi - lo) * block_bytes)) for (lo, hi), offset in zip(todo, offsets)]
        filling = asyncio.ensure_future(export(parts))
        try:
            await asyncio.shield(filling)
        except asyncio.CancelledError:
            # the export runs on the engine thread to its end whatever happens here: the slots come back after it
            filling.add_done_callback(lambda _: [arena.give(offset) for offset in offsets])
            raise
        except BaseException:
            for offset in offsets:
                arena.give(offset)  # nothing was sent: the store never saw these slots
            raise
        sent = [self._put_slot(arena, offset, keys[lo:hi], [block_bytes] * (hi - lo), ttl_s)
                for (lo, hi), offset in zip(todo, offsets)]
        results = await asyncio.gather(*sent)
        lost = [(lo, hi) for (lo, hi), n in zip(todo, results) if n is None]
        stored = sum(n for n in results if n is not None)
        if lost:  # the store cannot map the arena after all: those blocks over NATS
            stored += await self._put_window(lost, keys, export, block_bytes, ttl_s)
        return stored

    async def _put_slot(self, arena: Arena, offset: int, keys: Sequence[bytes], lengths: list[int], ttl_s: float
                        ) -> int | None:
        """Have the store take the blobs (of `lengths`) lying in the slot at `offset`: how many it stored (0 when
        it did not answer: the slot is retired until its deadline); None: it cannot map the arena. The slot is
        settled either way."""
        deadline = time.monotonic() + self._timeout
        request = KvPutShm(list(keys), lengths, str(arena.path), arena.token, offset, ttl_s, deadline)
        reply = await self._shm_request(arena, offset, deadline, subjects.KV_PUT_SHM, request)
        if reply is None:
            return 0
        arena.give(offset)
        if not reply.mapped:
            return None
        self.counts["blocks_via_shm"] += len(keys)
        return sum(reply.stored)

    async def _put_window(self, todo: list[tuple[int, int]], keys: Sequence[bytes], export: Exporter,
                          block_bytes: int, ttl_s: float) -> int:
        """Batches over NATS: exported into one buffer (one export call), sent pipelined."""
        first, last = todo[0][0], todo[-1][1]
        buf = memoryview(bytearray((last - first) * block_bytes))
        await export([(lo, hi, buf[(lo - first) * block_bytes : (hi - first) * block_bytes]) for lo, hi in todo])
        calls = []
        for lo, hi in todo:
            blobs = [bytes(buf[(i - first) * block_bytes : (i - first + 1) * block_bytes]) for i in range(lo, hi)]
            calls.append(((hi - lo) * block_bytes, functools.partial(self._put_nats, list(keys[lo:hi]), blobs, ttl_s)))
        stored = 0
        async with contextlib.aclosing(self._ordered(calls)) as replies:
            async for n in replies:
                stored += n
        return stored

    def _batches(self, items: list[tuple[bytes, bytes]]) -> list[list[tuple[bytes, bytes]]]:
        """Consecutive items, as many a batch as fit `message_bytes` (a bigger blob alone)."""
        batches: list[list[tuple[bytes, bytes]]] = []
        size = self._message_bytes
        for key, blob in items:
            if not batches or size + len(blob) > self._message_bytes:
                batches.append([])
                size = 0
            batches[-1].append((key, blob))
            size += len(blob)
        return batches

    async def _ordered(self, calls: list[tuple[int, Callable[[], Awaitable[R]]]]) -> AsyncIterator[R]:
        """The results of `calls` ((bytes, call) pairs) in order, with at most `window_bytes` of them in flight
        (always at least one); leaving early cancels the rest."""
        flying: deque[tuple[int, asyncio.Future[R]]] = deque()
        load = 0
        try:
            for weight, call in calls:
                while flying and load + weight > self._window_bytes:
                    done_weight, task = flying.popleft()
                    load -= done_weight
                    yield await task
                flying.append((weight, asyncio.ensure_future(call())))
                load += weight
            while flying:
                yield await flying.popleft()[1]
        finally:
            for _, task in flying:
                task.cancel()

    async def _get_chunk(self, keys: Sequence[bytes]) -> KvGetRunReply | None:
        if self.arena is not None:
            reply = await self._get_shm(self.arena, keys)
            if reply is not False:
                return reply
        try:
            return await self._bus.request(
                subjects.KV_GET_RUN, KvGetRun(list(keys), self._message_bytes), KvGetRunReply, timeout=self._timeout
            )
        except BusTimeout as exc:
            log.warning("kv get failed: %s", exc)
            self.counts["gets_failed"] += 1
            return None

    async def _put_batch(self, batch: list[tuple[bytes, bytes]], ttl_s: float) -> int:
        """How many of `batch` the store stored (0 when it did not answer)."""
        keys, blobs = [k for k, _ in batch], [b for _, b in batch]
        if self.arena is not None:
            stored = await self._put_shm(self.arena, keys, blobs, ttl_s)
            if stored is not None:
                return stored
        return await self._put_nats(keys, blobs, ttl_s)

    async def _put_nats(self, keys: list[bytes], blobs: list[bytes], ttl_s: float) -> int:
        try:
            reply = await self._bus.request(
                subjects.KV_PUT_BATCH, KvPutBatch(keys, blobs, ttl_s), KvPutBatchReply, timeout=self._timeout
            )
        except BusTimeout as exc:
            log.warning("kv put failed: %s", exc)
            return 0
        return sum(reply.stored)

    # --- the shared-memory path: False / None = not taken, send over NATS -------------------------------------

    async def _get_shm(self, arena: Arena, keys: Sequence[bytes]) -> KvGetRunReply | None | bool:
        offset = arena.take()
        if offset is None:
            return False
        deadline = time.monotonic() + self._timeout
        request = KvGetRunShm(list(keys), str(arena.path), arena.token, offset, arena.slot_bytes, deadline)
        reply = await self._shm_request(arena, offset, deadline, subjects.KV_GET_SHM, request)
        if reply is None:
            self.counts["gets_failed"] += 1
            return None
        if not reply.mapped or not (reply.lengths or reply.ended):
            arena.give(offset)
            return False  # not mapped, or the next blob is bigger than a slot: that one goes over NATS
        self.counts["blocks_via_shm"] += len(reply.lengths)
        if reply.lengths and arena.free_slots >= self._reserve:
            return KvGetRunReply(arena.lend(offset, reply.lengths), reply.ended)  # the slot comes back with them
        blobs = arena.read(offset, reply.lengths)
        arena.give(offset)
        return KvGetRunReply(blobs, reply.ended)

    async def _get_heap(self, arena: Arena, keys: Sequence[bytes]) -> list[Blob] | None:
        """Views of the store's heap for the leading run of `keys` its RAM tier holds ([] for none, or when
        anything is wrong: the caller reads those blocks the arena's way); None when the store did not answer."""
        request = KvGetHeap(list(keys), str(arena.path), arena.token, time.monotonic() + self._timeout)
        try:
            reply = await self._bus.request(subjects.KV_GET_HEAP, request, KvHeapReply, timeout=self._timeout)
        except BusTimeout as exc:
            log.warning("kv heap get failed: %s", exc)
            self.counts["gets_failed"] += 1
            return None  # if it was granted, the lease ends at its deadline
        if not reply.heap:
            self.heap_on = False  # no shared heap there, or not for this host: stop asking
            return []
        if not reply.lease:
            return []
        if self.heap is None or not self.heap.names(reply.heap, reply.token):
            self.heap = HeapMap.open(reply.heap, reply.token)  # (re)map: a first reply, or a restarted store
            if self.heap is not None and self.on_heap is not None:
                self.on_heap(self.heap)
        release = functools.partial(self._release_heap, asyncio.get_running_loop(), reply.instance,
                                    KvHeapRelease(reply.lease, reply.token))
        views = self.heap.lend(reply.offsets, reply.lengths, reply.deadline, release) if self.heap else None
        if views is None:  # not mapped (token, map failure) or the lease ended first: never read those bytes
            self.counts["heap_refused"] += 1
            release()
            return []
        self.counts["blocks_via_heap"] += len(views)
        return list(views)

    def _release_heap(self, loop: asyncio.AbstractEventLoop, instance: str, message: KvHeapRelease) -> None:
        """End a heap lease (fire and forget), from whichever thread dropped the last view."""

        def send() -> None:
            task = asyncio.ensure_future(self._bus.publish(subjects.kv_heap_release(instance), message))
            task.add_done_callback(_quiet)

        try:
            loop.call_soon_threadsafe(send)
        except RuntimeError:  # the loop is closed (shutting down): the lease ends at its deadline
            pass

    async def _put_shm(self, arena: Arena, keys: list[bytes], blobs: list[bytes], ttl_s: float) -> int | None:
        if sum(map(len, blobs)) > arena.slot_bytes or (offset := arena.take()) is None:
            return None
        return await self._put_slot(arena, offset, keys, arena.write(offset, blobs), ttl_s)

    async def _shm_request(self, arena: Arena, offset: int, deadline: float, subject: str, request: object
                           ) -> KvShmReply | None:
        """The store's reply; None on a timeout (the slot is retired until past `deadline`: the store may write
        into it until then). A store that cannot map the arena turns the shared-memory path off for this client.
        Cancelled (a run that ended before this chunk, a cancelled request), the request still runs to its end in
        the background and settles the slot then: the store may be writing into it right now."""
        sent = asyncio.ensure_future(self._bus.request(subject, request, KvShmReply, timeout=self._timeout))
        try:
            reply = await asyncio.shield(sent)
        except asyncio.CancelledError:
            sent.add_done_callback(lambda done: _settle(arena, offset, deadline, done))
            raise
        except BusTimeout as exc:
            log.warning("kv %s failed: %s", subject, exc)
            arena.lose(offset, deadline)
            return None
        if not reply.mapped and self.arena is arena:
            log.warning("the kvcache service cannot map %s (another host?): KV bytes go over NATS", arena.path)
            self.arena = None
            self.counts["arena_refused"] += 1
        return reply


def _quiet(task: asyncio.Future[None]) -> None:
    """A release not sent (the bus is gone): its lease ends at its deadline anyway."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("kv heap release not sent: %s", task.exception())


def _settle(arena: Arena, offset: int, deadline: float, done: asyncio.Future[KvShmReply]) -> None:
    """The slot of a request nobody waits for any more: lent again once the store answered, else retired until
    its deadline has passed."""
    if done.cancelled() or done.exception() is not None:
        arena.lose(offset, deadline)
    else:
        arena.give(offset)


# --- big short-term blobs, in parts ---------------------------------------------------------------------------
# A snapshot (shared/worker/short_term.py) holds DeepSeek-V4's rings: megabytes (V4-Flash in bfloat16: 12.6 MiB, over
# NATS's payload limit), so it travels in parts that each fit one message.


def part_key(key: bytes, i: int) -> bytes:
    return key if i == 0 else key + b"#%d" % i


def split_parts(key: bytes, blob: bytes, part_bytes: int) -> list[tuple[bytes, bytes]]:
    """`blob` as (key, bytes) parts of `part_bytes` (the last one shorter; part 0 also has the 4-byte count)."""
    assert part_bytes > 0
    chunks = [blob[at : at + part_bytes] for at in range(0, len(blob), part_bytes)] or [b""]
    chunks[0] = _PART_COUNT.pack(len(chunks)) + chunks[0]
    return [(part_key(key, i), chunk) for i, chunk in enumerate(chunks)]


async def put_parts(kv: KvClient, key: bytes, blob: bytes, part_bytes: int) -> bool:
    """Store `blob` under `key` in parts (short-term TTL); True when every part was stored."""
    return await kv.put_many(split_parts(key, blob, part_bytes), ttl_s=SHORT_TERM_TTL_S)


async def get_parts(kv: KvClient, key: bytes) -> tuple[bytes, list[bytes]]:
    """(the blob put_parts stored under `key`, b"" if any part is missing; the keys of its parts, to delete)."""
    first = await kv.get_run([key])
    if not first or len(first[0]) < _PART_COUNT.size:
        return b"", [key]
    (n,) = _PART_COUNT.unpack_from(first[0])
    keys = [part_key(key, i) for i in range(max(n, 1))]
    rest = await kv.get_run(keys[1:])
    if len(rest) < n - 1:
        return b"", keys
    return b"".join([first[0][_PART_COUNT.size :], *rest]), keys
