"""Client side of the kvcache service, used by prefill and decode workers.

The store is an optimisation, never a dependency: every call degrades to "not cached" when the kvcache service
is slow or gone, and the worker recomputes. One block rides in one message (a block is well under NATS's
payload limit); many blocks move as concurrent requests.
"""

from __future__ import annotations

import asyncio
import logging
import struct

from shared import subjects
from shared.bus import Bus, BusTimeout
from shared.schemas.kv import (
    KvGet,
    KvGetReply,
    KvLookup,
    KvLookupReply,
    KvPut,
    KvPutReply,
    KvStats,
    KvStatsReply,
)

log = logging.getLogger(__name__)

SHORT_TERM_TTL_S = 180.0
_PART_COUNT = struct.Struct("<I")  # a state's first part starts with how many parts there are


class KvClient:
    def __init__(self, bus: Bus, timeout: float = 5.0) -> None:
        self._bus = bus
        self._timeout = timeout

    async def lookup(self, hashes: list[bytes]) -> int:
        """Length of the longest stored prefix run of `hashes` (0 when the store is unreachable)."""
        if not hashes:
            return 0
        try:
            reply = await self._bus.request(subjects.KV_LOOKUP, KvLookup(hashes), KvLookupReply, timeout=self._timeout)
        except BusTimeout as exc:
            log.warning("kv lookup failed, recomputing: %s", exc)
            return 0
        return reply.hits

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
            return KvLookupReply(hits=0)

    async def stats(self) -> KvStatsReply | None:
        """One kvcache instance's tier counters, or None when none answers."""
        try:
            return await self._bus.request(subjects.KV_STATS, KvStats(), KvStatsReply, timeout=self._timeout)
        except BusTimeout:
            return None

    async def get_run(self, keys: list[bytes]) -> list[bytes]:
        """The blobs of `keys` up to (not including) the first one missing."""
        replies = await asyncio.gather(*(self._get_one(k) for k in keys))
        run: list[bytes] = []
        for blob in replies:
            if blob is None:
                break
            run.append(blob)
        return run

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Each key's blob, or None where absent (or the store is unreachable): one request for all of them,
        for small entries (the reply must fit one message)."""
        if not keys:
            return []
        try:
            reply = await self._bus.request(subjects.KV_GET, KvGet(keys), KvGetReply, timeout=self._timeout)
        except BusTimeout as exc:
            log.warning("kv get failed: %s", exc)
            return [None] * len(keys)
        return [*reply.blobs, *[None] * (len(keys) - len(reply.blobs))][: len(keys)]

    async def _get_one(self, key: bytes) -> bytes | None:
        try:
            reply = await self._bus.request(subjects.KV_GET, KvGet([key]), KvGetReply, timeout=self._timeout)
        except BusTimeout as exc:
            log.warning("kv get failed: %s", exc)
            return None
        return reply.blobs[0] if reply.blobs else None

    async def put_many(self, items: list[tuple[bytes, bytes]], ttl_s: float = 0.0) -> bool:
        """Store (key, blob) pairs; True when all were stored."""
        results = await asyncio.gather(*(self._put_one(k, v, ttl_s) for k, v in items))
        return all(results)

    async def _put_one(self, key: bytes, blob: bytes, ttl_s: float) -> bool:
        try:
            reply = await self._bus.request(subjects.KV_PUT, KvPut(key, blob, ttl_s), KvPutReply, timeout=self._timeout)
        except BusTimeout as exc:
            log.warning("kv put failed: %s", exc)
            return False
        return reply.stored


# --- big short-term blobs, in parts ---------------------------------------------------------------------------
# A snapshot (shared/short_term.py) holds DeepSeek-V4's rings: megabytes (V4-Flash in bfloat16: 12.6 MiB, over
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
