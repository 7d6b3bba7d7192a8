"""The kvcache service: `kv.lookup / kv.get / kv.put / kv.delete` over the store, `kv.stats` for /metrics, plus a
periodic sweep.

The store's tiers (see store.py): RAM (hot copies), LMDB at `<state_dir>/kvcache/` (short-term entries, warm
blocks) and the SSD tier at `<state_dir>/kvcache/ssd/` (long-term blocks, kept for days across restarts).

The disk tiers run on one dedicated I/O thread: LMDB reads of a cold page and fsyncs can block, and they are not
thread-safe, so one thread both keeps the event loop free and serializes access. The environment is opened on
that thread when the service starts (never before a fork). What the RAM tier holds is served on the event loop
at once (store.py: `hot_lookup`, `hot_run`, `put_hot`), so a RAM hit never queues behind a disk write; a put's
write to its home tier still happens (write-through) and the reply waits for it, off the read path.

Bulk traffic comes batched: `kv.get.run` answers a prefix run with as many blocks as one reply carries, and
`kv.put.batch` stores many blocks per message; clients keep a bounded number of them in flight (kvclient.py).

Same-host workers read RAM hits by descriptor (`kv.get.heap`): the RAM tier's payloads lie in a shared-memory
heap this service owns (heap.py, shared/kv_heap.py; `--ram-heap auto`, the default), and the reply says where,
under a read lease the worker ends with `kv.heap.release.<instance>` once its engine imported the blocks (or
that ends at its deadline). The store copies nothing for such a get.

Instances in the `kvcache` queue group each own their store; run one per state directory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, TypeVar

import orjson

from services.kvcache.config import DAY_S, KvCacheConfig
from services.kvcache.heap import Heap, HeapPayloads, open_heap
from services.kvcache.leases import Leases
from services.kvcache.malloc import retain_freed_memory
from services.kvcache.store import KvStore
from services.kvcache.tiers.lmdb import LmdbTier
from services.kvcache.tiers.ram import RamTier
from services.kvcache.tiers.ssd import SsdTier
from shared import subjects
from shared.bus import Bus, Subscription
from shared.kv_arena import ArenaMaps
from shared.kv_events import EventPublisher
from shared.schemas.kv import (
    KvDelete,
    KvDeleteReply,
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
    KvPut,
    KvPutBatch,
    KvPutBatchReply,
    KvPutReply,
    KvPutShm,
    KvShmReply,
    KvStats,
    KvStatsReply,
    KvTierStats,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

REPLY_OVERHEAD = 4096  # msgpack framing and headers around the blobs of a get reply


class KvCacheService:
    name = "kvcache"

    def __init__(self, config: KvCacheConfig) -> None:
        self.config = config
        self.store: KvStore | None = None
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-io")
        self._subs: list[Subscription] = []
        self._sweeper: asyncio.Task[None] | None = None
        self._max_reply = 0
        self.events: EventPublisher | None = None
        self._arenas = ArenaMaps()  # same-host workers' shared memory (shared/kv_arena.py)
        self.late_shm = 0  # shm requests that came past their deadline (refused: the slot is not theirs any more)
        self.heap: Heap | None = None  # the RAM tier's shared heap (None: --ram-heap off, or no room in /dev/shm)

    # --- Service protocol --------------------------------------------------------------------------------------

    async def start(self, bus: Bus) -> None:
        self.store = await self._run(self._open)
        self._max_reply = bus.max_payload - REPLY_OVERHEAD
        # every long-term change goes out as a numbered event, so the balancers' prefix index stays exact
        self.events = EventPublisher(bus, self.config.instance)
        await self._run(self.store.watch, self.events)  # the store calls it on its I/O thread
        await self.events.serve_snapshots(self.store.long_term_keys, run=self._run)
        group = subjects.KVCACHE_GROUP
        self._subs = [
            await bus.serve(subjects.KV_LOOKUP, KvLookup, self._lookup, queue=group),
            await bus.serve(subjects.KV_GET, KvGet, self._get, queue=group),
            await bus.serve(subjects.KV_PUT, KvPut, self._put, queue=group),
            await bus.serve(subjects.KV_GET_RUN, KvGetRun, self._get_run, queue=group),
            await bus.serve(subjects.KV_PUT_BATCH, KvPutBatch, self._put_batch, queue=group),
            await bus.serve(subjects.KV_GET_SHM, KvGetRunShm, self._get_shm, queue=group),
            await bus.serve(subjects.KV_PUT_SHM, KvPutShm, self._put_shm, queue=group),
            await bus.serve(subjects.KV_GET_HEAP, KvGetHeap, self._get_heap, queue=group),
            await bus.subscribe(subjects.kv_heap_release(self.config.instance), KvHeapRelease, self._release_heap),
            await bus.serve(subjects.KV_DELETE, KvDelete, self._delete, queue=group),
            await bus.serve(subjects.KV_STATS, KvStats, self._stats),  # every instance answers for itself
        ]
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs = []
        if self.events is not None:
            await self.events.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self.store is not None:
            await self._run(self.store.close)
            self.store = None
        self._io.shutdown(wait=True)
        self._arenas.close()

    def health(self) -> tuple[bool, str]:
        if self.store is None:
            return False, "store not open"
        if not self._subs:  # set once every subject is subscribed: ready means every request has a responder
            return False, "subscribing"
        # Counters are plain ints written by the I/O thread; a slightly torn snapshot is fine for a report.
        return True, orjson.dumps({**self.store.stats(), "heap": self.heap_stats()}).decode()

    def heap_stats(self) -> dict[str, int]:
        """The shared heap's state: leases granted / released / expired / held now, blobs held, frees deferred."""
        ram = self.store.ram_payloads() if self.store is not None else None
        if self.heap is None or not isinstance(ram, HeapPayloads):
            return {}
        return {"lent": ram.lent, "released": ram.released, "expired": ram.expired, "leases": ram.leases,
                "held": self.heap.held, "deferred": self.heap.deferred, "free_bytes": self.heap.free_bytes}

    # --- handlers ----------------------------------------------------------------------------------------------

    async def _lookup(self, req: KvLookup) -> KvLookupReply:
        assert self.store is not None
        run = self.store.hot_lookup(req.hashes, req.lease_s)  # all in RAM: no wait behind the disk
        if run is None:
            run = await self._run(self.store.lookup, req.hashes, req.lease_s)
        return KvLookupReply(
            hits=run.hits,
            tiers=dict(run.by_tier),
            lease_s=run.lease_s,
        )

    async def _get(self, req: KvGet) -> KvGetReply:
        assert self.store is not None
        return KvGetReply(blobs=self._fit(await self._run(self.store.get, req.keys)))

    async def _get_run(self, req: KvGetRun) -> KvGetRunReply:
        hard = self._max_reply
        limit = min(req.max_bytes, hard) if req.max_bytes > 0 else hard
        run, at_miss = await self._read_run(req.keys, limit, hard)
        return KvGetRunReply(blobs=run, ended=at_miss)

    async def _get_shm(self, req: KvGetRunShm) -> KvShmReply:
        arena = self._arenas.get(req.arena, req.token)
        if arena is None or not 0 < req.offset <= len(arena) - req.capacity:
            return KvShmReply(mapped=False)
        run, at_miss = await self._read_run(req.keys, req.capacity, req.capacity)
        arena = self._arenas.get(req.arena, req.token)  # again: the sweep may have unmapped it meanwhile
        if arena is None:
            return KvShmReply(mapped=False)
        if _late(req.deadline):  # the worker gave up on this slot and may lend it again: never write into it
            self.late_shm += 1
            return KvShmReply(mapped=True, lengths=[], ended=False)
        at = req.offset  # from here to the reply no await: the writes end within the grace after the deadline
        for blob in run:
            arena[at : at + len(blob)] = blob
            at += len(blob)
        return KvShmReply(mapped=True, lengths=[len(b) for b in run], ended=at_miss)

    async def _get_heap(self, req: KvGetHeap) -> KvHeapReply:
        """Where the run's RAM part lies in the heap, leased: only to a reader whose arena this store maps (on its
        host, so it can map the heap too)."""
        assert self.store is not None
        heap = self.heap
        if heap is None or self._arenas.get(req.arena, req.token) is None:
            return KvHeapReply(heap="")
        deadline = min(req.deadline, time.monotonic() + self.config.max_lease_s)
        if _late(deadline):
            return KvHeapReply(str(heap.path), heap.token, self.config.instance)
        lease, refs = self.store.lend_hot(req.keys, deadline)
        return KvHeapReply(str(heap.path), heap.token, self.config.instance, lease, [r.offset for r in refs],
                           [r.length for r in refs], deadline)

    async def _release_heap(self, req: KvHeapRelease, _: object) -> None:
        if self.store is not None and self.heap is not None and req.token == self.heap.token:
            self.store.release_hot(req.lease)

    async def _read_run(self, keys: list[bytes], limit: int, first: int) -> tuple[list[bytes], bool]:
        """The leading run of `keys` within `limit` bytes (the first blob within `first`): RAM's part on the loop,
        the rest from the disk tiers on the I/O thread. True when it ended at an absent key."""
        assert self.store is not None
        store = self.store
        run, at_miss = store.hot_run(keys, limit, first)
        if at_miss:  # RAM lacks the next key: the disk tiers may have it (and the run's rest)
            used = sum(map(len, run))
            more, at_miss = await self._run(store.read_run, keys[len(run) :], limit - used,
                                            limit - used if run else first)
            run += more
        return run, at_miss

    async def _put_shm(self, req: KvPutShm) -> KvShmReply:
        arena = self._arenas.get(req.arena, req.token)
        end = req.offset + sum(req.lengths)
        if (arena is None or len(req.lengths) != len(req.keys) or min(req.lengths, default=0) < 0
                or not 0 < req.offset <= end <= len(arena)):
            return KvShmReply(mapped=False)
        assert self.store is not None
        store = self.store
        whole = memoryview(arena)
        views, at = [], req.offset
        for n in req.lengths:
            views.append(whole[at : at + n])
            at += n
        # one copy each (into RAM, the heap where it is on), the slot going back to the worker with the reply;
        # dropped again if the worker gave the slot up meanwhile: the bytes may be another batch's
        staged = store.put_hot_from(req.keys, views, req.ttl_s, lambda: not _late(req.deadline))
        views.clear()
        whole.release()  # before any await: the sweep may unmap the arena
        if staged is None:
            self.late_shm += 1
            return KvShmReply(mapped=True, stored=[False] * len(req.keys))

        def write_home() -> list[bool]:
            return [e is not None and store.put_home(k, b, e) for k, (e, b) in zip(req.keys, staged)]

        return KvShmReply(mapped=True, stored=await self._run(write_home))

    async def _put(self, req: KvPut) -> KvPutReply:
        (stored,) = await self._store([req.key], [req.data], req.ttl_s)
        return KvPutReply(stored=stored)

    async def _put_batch(self, req: KvPutBatch) -> KvPutBatchReply:
        if len(req.keys) != len(req.blobs):
            log.warning("kv.put.batch with %d keys and %d blobs: refused", len(req.keys), len(req.blobs))
            return KvPutBatchReply(stored=[False] * len(req.keys))
        return KvPutBatchReply(stored=await self._store(req.keys, req.blobs, req.ttl_s))

    async def _store(self, keys: list[bytes], blobs: list[bytes], ttl_s: float) -> list[bool]:
        """RAM copies now, on the loop (readable at once), then the home tiers' writes on the I/O thread."""
        assert self.store is not None
        store = self.store
        expiries = [store.put_hot(key, blob, ttl_s) for key, blob in zip(keys, blobs)]

        def write_home() -> list[bool]:
            return [e is not None and store.put_home(k, b, e) for k, b, e in zip(keys, blobs, expiries)]

        return await self._run(write_home)

    async def _delete(self, req: KvDelete) -> KvDeleteReply:
        assert self.store is not None
        return KvDeleteReply(deleted=await self._run(self.store.delete, req.keys))

    async def _stats(self, _: KvStats) -> KvStatsReply:
        assert self.store is not None
        # Read on the event loop, like health(): plain counters, so /metrics never waits behind a disk read.
        store = self.store
        per_tier = store.tier_stats()
        tiers = {
            name: KvTierStats(
                entries=s.entries,
                bytes=s.bytes,
                capacity_bytes=s.capacity_bytes,
                disk_bytes=s.disk_bytes,
                hits=t.hits,
                misses=t.misses,
                evictions=s.evictions,
                expired=s.expired,
                corrupt=s.corrupt,
                promotions=t.promotions,
            )
            for name, s, t in per_tier
        }
        return KvStatsReply(self.config.instance, tiers, asdict(store.counters), len(store.leases))

    def _fit(self, blobs: list[bytes | None]) -> list[bytes | None]:
        """Blobs up to the reply size limit, the rest as misses: callers read prefix runs and recompute the rest."""
        room = self._max_reply
        out: list[bytes | None] = []
        for blob in blobs:
            if blob is not None and len(blob) > room:
                log.warning("kv.get reply over the payload limit: ask for fewer keys per request")
                return out + [None] * (len(blobs) - len(out))
            room -= len(blob or b"")
            out.append(blob)
        return out

    # --- internals ---------------------------------------------------------------------------------------------

    def _open(self) -> KvStore:
        cfg = self.config
        retain_freed_memory()  # every read allocates its blocks afresh: see malloc.py
        leases = Leases()
        lmdb = LmdbTier(cfg.root, capacity_bytes=cfg.capacity_bytes, map_size=cfg.map_size, leases=leases)
        self.heap = open_heap(cfg.instance, cfg.ram_bytes) if cfg.ram_bytes and cfg.ram_heap == "auto" else None
        payloads = HeapPayloads(self.heap) if self.heap is not None else None
        ram = RamTier(capacity_bytes=cfg.ram_bytes, leases=leases, payloads=payloads) if cfg.ram_bytes else None
        ssd = None
        if cfg.ssd_bytes:
            ssd = SsdTier(
                cfg.root / "ssd",
                capacity_bytes=cfg.ssd_bytes,
                ttl_s=cfg.ssd_ttl_days * DAY_S,
                segment_bytes=cfg.segment_bytes,
                leases=leases,
            )
        store = KvStore(
            ram=ram,
            short_term=lmdb,
            long_term=ssd,
            max_ttl_s=cfg.tail_ttl_s,
            max_lease_s=cfg.max_lease_s,
            leases=leases,
        )
        for tier in store.tiers:
            log.info("kvcache %s tier: %s", tier.name, tier.stats())
        return store

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            assert self.store is not None
            try:
                expired = await self._run(self.store.sweep)
            except Exception:
                log.exception("kvcache sweep failed")
                continue
            if expired:
                log.debug("expired %d entries", expired)
            if self._arenas.sweep():
                log.info("unmapped the arenas of stopped or dead workers; %d mapped", len(self._arenas))

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)


def _late(deadline: float) -> bool:
    return deadline > 0 and time.monotonic() >= deadline
