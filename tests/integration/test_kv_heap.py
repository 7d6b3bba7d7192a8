"""The store's RAM tier in a shared heap, read by same-host workers by descriptor (issue 11), on a real
nats-server with the real LMDB and SSD tiers: a get by descriptor returns the bytes that were put, as read-only
views of the store's heap the engine imports from; a killed reader's lease ends at its deadline and the bytes it
held are freed then; a restarted store's heap is never read through a map of the old one.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

from services.kvcache.config import KvCacheConfig
from services.kvcache.service import KvCacheService
from shared import hashing
from shared.bus import Bus
from shared.kv_heap import HeapMap
from shared.launch.process import die_with_parent
from shared.worker.kvclient import open_client
from tests.integration.test_kv_arena_faults import _until
from tests.integration.test_kv_faults import kill, payload

BLOCK = 96 * 1024  # payload()'s size


def _config(root: Path, instance: str, **kw: object) -> KvCacheConfig:
    base = dict(capacity_bytes=32 << 20, map_size=64 << 20, ram_bytes=16 << 20, ssd_bytes=128 << 20,
                sweep_interval_s=0.1, instance=instance)
    return KvCacheConfig(root / "kvcache", **{**base, **kw})  # type: ignore[arg-type]


def _keys(n: int, name: str) -> list[bytes]:
    return hashing.block_hashes(list(range(n * hashing.BLOCK_TOKENS)), hashing.namespace(name))


async def test_a_get_by_descriptor_returns_what_was_put_as_views_of_the_heap(nats_url: str, tmp_path: Path) -> None:
    """RAM hits come back as views of the store's heap (no copy by the store), the engine imports from them, and
    the lease is released once they are dropped; the part RAM lacks comes the arena's way; with the heap off the
    same gets go through the arena with the same bytes."""
    import torch

    from shared.engine.kv_cache import CacheSpec, KVCache, PagedSpec

    service = KvCacheService(_config(tmp_path, "kv-heap"))
    bus = await Bus.connect(nats_url, "kv-heap")
    client = open_client(bus, "shm", f"test-heap-{os.getpid()}", message_bytes=4 * BLOCK, window_bytes=8 * BLOCK,
                         arena_bytes=32 * BLOCK)
    try:
        await service.start(bus)
        heap = service.heap
        assert heap is not None and heap.path.exists()
        keys = _keys(24, "heap")
        assert await client.put_many([(k, payload(k)) for k in keys[:20]])
        got = await client.get_run(keys)
        assert [bytes(b) for b in got] == [payload(k) for k in keys[:20]]
        assert client.counts["blocks_via_heap"] == 20 and client.heap is not None
        assert all(isinstance(b, memoryview) and b.readonly for b in got)
        assert service.heap_stats()["leases"] == 1 and client.heap.locks_held == 20

        # the engine imports straight from the views (BLOCK bytes = a block of this layout)
        spec = CacheSpec(PagedSpec(num_layers=3, num_kv_heads=2, head_dim=64, block_tokens=32,
                                   dtype=torch.float32), 0)
        cache = KVCache(spec, 24, torch.device("cpu"))
        assert cache.block_bytes == BLOCK
        cache.write_blocks(list(range(20)), got)
        assert cache.read_blocks(list(range(20))) == [payload(k) for k in keys[:20]]
        del got
        gc.collect()
        assert client.heap.locks_held == 0
        await _until(lambda: service.heap_stats()["leases"] == 0)  # released by message, long before its deadline
        assert service.heap_stats()["released"] == 1 and service.heap_stats()["expired"] == 0

        # RAM holds only part of a run: the heap answers the part it has, the arena the rest (from disk)
        assert service.store is not None and service.store._ram is not None
        service.store._ram.delete(keys[10:20])  # as if evicted from RAM (SSD still holds them)
        before = client.counts["blocks_via_shm"]
        got = await client.get_run(keys[:20])
        assert [bytes(b) for b in got] == [payload(k) for k in keys[:20]]
        assert client.counts["blocks_via_heap"] == 30 and client.counts["blocks_via_shm"] - before == 10
        del got

        # cancelled between the heap's part and the arena's (the client left): the views go, so do the locks and
        # the lease; the arena's slots come back
        service.store._ram.delete(keys[10:20])
        get = asyncio.create_task(client.get_run(keys[:20]))
        while client.counts["blocks_via_heap"] < 40:
            assert not get.done()
            await asyncio.sleep(0)
        get.cancel()
        await asyncio.gather(get, return_exceptions=True)
        assert get.cancelled()
        gc.collect()
        assert client.heap.locks_held == 0
        await _until(lambda: service.heap_stats()["leases"] == 0 and client.arena.free_slots == client.arena.slots)

        # a reply whose token the heap file does not show (as a map of another heap would): never read, those
        # blocks come the arena's way, and the lease is released at once
        heap.token = b"not this heap..."
        client.heap = None
        got = await client.get_run(keys[:10])
        assert [bytes(b) for b in got] == [payload(k) for k in keys[:10]]
        assert client.counts["heap_refused"] == 1 and client.counts["blocks_via_heap"] == 40
        await _until(lambda: service.heap_stats()["leases"] == 0)
        del got
    finally:
        await service.stop()
        await bus.drain()
        if client.arena is not None:
            client.arena.close()
    assert not heap.path.exists()


READER = """
import asyncio, sys
from shared.bus import Bus
from shared.worker.kvclient import KvClient, open_client
from tests.integration.test_kv_heap import BLOCK, _keys

async def main(url, instance):
    bus = await Bus.connect(url, instance)
    kv = open_client(bus, "shm", instance, message_bytes=4 * BLOCK, window_bytes=8 * BLOCK, arena_bytes=32 * BLOCK)
    kv._timeout = 1.0  # the lease it asks for: the request's timeout
    got = await kv.get_run(_keys(8, "killed-reader"))
    print(len(got), kv.counts["blocks_via_heap"], flush=True)
    await asyncio.sleep(3600)  # holding the views (and their read locks) until killed

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_killed_readers_lease_ends_at_its_deadline_and_the_bytes_are_freed(nats_url: str, tmp_path: Path
                                                                                   ) -> None:
    """A worker holding views of the heap is SIGKILLed: the blocks it leased were deleted meanwhile, so their
    bytes are freed only when its lease ends; the kernel dropped its read locks with it, so that is at the
    lease's deadline (plus the grace), never while it still held them."""
    service = KvCacheService(_config(tmp_path, "kv-heap-kill", max_lease_s=1.0))
    bus = await Bus.connect(nats_url, "kv-heap-kill")
    instance = f"test-reader-{os.getpid()}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    reader = None
    try:
        await service.start(bus)
        heap = service.heap
        assert heap is not None and service.store is not None
        keys = _keys(8, "killed-reader")
        writer = open_client(bus, "shm", f"test-writer-{os.getpid()}", message_bytes=4 * BLOCK,
                             window_bytes=8 * BLOCK, arena_bytes=32 * BLOCK)
        assert await writer.put_many([(k, payload(k)) for k in keys])
        free_before = heap.free_bytes
        reader = subprocess.Popen([sys.executable, "-c", READER, nats_url, instance], stdout=subprocess.PIPE,
                                  env=env, preexec_fn=die_with_parent)
        assert reader.stdout is not None
        line = await asyncio.to_thread(reader.stdout.readline)
        assert line.split() == [b"8", b"8"]  # every block by descriptor
        granted = time.monotonic()
        assert await service._run(service.store.delete, keys) == 8  # deleted while leased
        assert heap.deferred == 8 and heap.free_bytes == free_before
        assert service.heap_stats()["leases"] == 1
        kill(reader)
        await _until(lambda: service.heap_stats()["leases"] == 0)
        assert time.monotonic() >= granted  # (ordering only: the end came after the kill)
        stats = service.heap_stats()
        assert stats["expired"] == 1 and stats["released"] == 0 and heap.deferred == 0
        assert heap.free_bytes == heap.capacity  # every deleted block's bytes freed
        if writer.arena is not None:
            writer.arena.close()
    finally:
        if reader is not None:
            kill(reader)
        await service.stop()
        await bus.drain()


async def test_a_restarted_stores_heap_is_not_read_through_an_old_map(nats_url: str, tmp_path: Path) -> None:
    """The store restarts (same instance, same state): its heap is a new file with a new token; the client
    remaps it on the first reply that names it, and the old map (still alive, views of it held) never shows the
    new store's bytes nor passes for the new heap."""
    bus = await Bus.connect(nats_url, "kv-heap-restart")
    client = open_client(bus, "shm", f"test-restart-{os.getpid()}", message_bytes=4 * BLOCK,
                         window_bytes=8 * BLOCK, arena_bytes=32 * BLOCK)
    keys = _keys(4, "restart")
    first = KvCacheService(_config(tmp_path, "kv-heap-restart"))
    try:
        await first.start(bus)
        assert await client.put_many([(k, payload(k)) for k in keys])
        old_views = await client.get_run(keys)  # held across the restart
        old_map = client.heap
        assert old_map is not None and client.counts["blocks_via_heap"] == 4
        old_path, old_token = str(old_map.path), old_map.token
    finally:
        await first.stop()
    assert not Path(old_path).exists()
    second = KvCacheService(_config(tmp_path, "kv-heap-restart"))
    try:
        await second.start(bus)
        assert second.heap is not None and second.heap.token != old_token and str(second.heap.path) != old_path
        assert HeapMap.open(old_path, old_token) is None  # the old heap is gone for good
        assert HeapMap.open(str(second.heap.path), old_token) is None  # and the new one is not it
        # other bytes under the same keys in the new store's heap (a long-term key names its content, but a
        # stale map must not even be consulted): a short-term put overwrites them
        assert await client.put_many([(k, b"\x01" * BLOCK) for k in keys], ttl_s=60.0)
        got = await client.get_run(keys)
        assert [bytes(b) for b in got] == [b"\x01" * BLOCK] * 4
        assert client.heap is not None and client.heap is not old_map and client.heap.token == second.heap.token
        assert client.counts["blocks_via_heap"] == 8
        assert [bytes(b) for b in old_views] == [payload(k) for k in keys]  # the old map shows the old store's
        del got, old_views
    finally:
        await second.stop()
        await bus.drain()
        if client.arena is not None:
            client.arena.close()
