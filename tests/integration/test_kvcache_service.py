"""The kvcache service on a real nats-server: put, lookup (tier split, leases), get, delete, stats over the bus, and
the gateway's /metrics rendering of them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import orjson
import prometheus_client

from services.gateway import kv_metrics
from services.kvcache.config import KvCacheConfig
from services.kvcache.service import KvCacheService
from shared import hashing, subjects
from shared.bus import Bus
from shared.worker.kvclient import KvClient, open_client
from shared.schemas.kv import (
    KvDelete,
    KvDeleteReply,
    KvGet,
    KvGetReply,
    KvLookup,
    KvLookupReply,
    KvPut,
    KvPutReply,
)

BLOCK = 256 * 1024


async def test_put_lookup_get_delete_over_the_bus(nats_url: str, tmp_path: Path) -> None:
    service = KvCacheService(
        KvCacheConfig(tmp_path / "kvcache", capacity_bytes=64 << 20, map_size=128 << 20, sweep_interval_s=0.1)
    )
    bus = await Bus.connect(nats_url, "kvcache-test")
    try:
        await service.start(bus)
        hashes = hashing.block_hashes(list(range(4 * hashing.BLOCK_TOKENS)), hashing.namespace("m"))
        blobs = [bytes([i]) * BLOCK for i in range(3)]
        for key, data in zip(hashes, blobs):
            reply = await bus.request(subjects.KV_PUT, KvPut(key, data), KvPutReply)
            assert reply.stored
        assert (await bus.request(subjects.KV_LOOKUP, KvLookup(hashes), KvLookupReply)).hits == 3

        got = await bus.request(subjects.KV_GET, KvGet([hashes[0], hashes[3], hashes[2]]), KvGetReply)
        assert got.blobs == [blobs[0], None, blobs[2]]

        # The workers' own client reads the same store.
        client = KvClient(bus)
        assert await client.get_run(hashes) == blobs

        put = KvPut(b"tail:r1", b"tail-bytes", ttl_s=0.2)
        assert (await bus.request(subjects.KV_PUT, put, KvPutReply)).stored
        assert (await bus.request(subjects.KV_GET, KvGet([b"tail:r1"]), KvGetReply)).blobs == [b"tail-bytes"]
        await asyncio.sleep(0.5)  # past the TTL and at least one sweep
        assert (await bus.request(subjects.KV_GET, KvGet([b"tail:r1"]), KvGetReply)).blobs == [None]

        deleted = await bus.request(subjects.KV_DELETE, KvDelete([hashes[1]]), KvDeleteReply)
        assert deleted.deleted == 1
        assert (await bus.request(subjects.KV_LOOKUP, KvLookup(hashes), KvLookupReply)).hits == 1

        ready, detail = service.health()
        stats = orjson.loads(detail)
        assert ready and stats["ssd"]["entries"] == 2 and stats["lmdb"]["expired"] == 1  # blocks on SSD, tail in LMDB
        assert stats["ram"]["entries"] == 2 and stats["lmdb"]["entries"] == 0
        assert stats["counters"]["get_hits"] >= 5
    finally:
        await service.stop()
        await bus.drain()


async def test_store_survives_a_service_restart(nats_url: str, tmp_path: Path) -> None:
    config = KvCacheConfig(tmp_path / "kvcache", capacity_bytes=16 << 20, map_size=32 << 20)
    key = hashing.block_hashes(list(range(hashing.BLOCK_TOKENS)), hashing.namespace("m"))[0]
    for round_ in range(2):
        service = KvCacheService(config)
        bus = await Bus.connect(nats_url, f"kvcache-restart-{round_}")
        try:
            await service.start(bus)
            if round_ == 0:
                assert (await bus.request(subjects.KV_PUT, KvPut(key, b"kv"), KvPutReply)).stored
            else:
                assert (await bus.request(subjects.KV_GET, KvGet([key]), KvGetReply)).blobs == [b"kv"]
        finally:
            await service.stop()
            await bus.drain()


async def test_lookup_reports_the_tier_split_and_leases_the_run(nats_url: str, tmp_path: Path) -> None:
    # RAM for two blocks, so of four stored blocks the first two are only on SSD.
    config = KvCacheConfig(tmp_path / "kvcache", capacity_bytes=16 << 20, map_size=32 << 20, ram_bytes=2 * BLOCK + 4096,
                           ssd_bytes=64 << 20, max_lease_s=10.0, instance="kv-split")
    service = KvCacheService(config)
    bus = await Bus.connect(nats_url, "kvcache-split")
    try:
        await service.start(bus)
        client = KvClient(bus, timeout=2.0)
        hashes = hashing.block_hashes(list(range(5 * hashing.BLOCK_TOKENS)), hashing.namespace("split"))
        blobs = [bytes([i]) * BLOCK for i in range(4)]
        assert await client.put_many(list(zip(hashes, blobs)))
        run = await client.lookup_run(hashes, lease_s=60.0)
        assert (run.hits, run.tiers, run.lease_s) == (4, {"ram": 2, "lmdb": 0, "ssd": 2}, 10.0)
        assert await client.lookup(hashes) == 4  # the old call still answers the run's length
        assert await client.get_run(hashes) == blobs

        stats = await client.stats()
        assert stats is not None and stats.instance == "kv-split" and stats.leases == 4
        by_tier = stats.tiers
        assert set(by_tier) == {"ram", "lmdb", "ssd"}
        assert by_tier["ssd"].hits == 2 and by_tier["ssd"].entries == 4
        assert by_tier["ram"].promotions == 0  # the RAM copies there are leased: the SSD hits were not promoted
        assert stats.counters["leases"] == 1

        scraped = kv_metrics.scraper(bus)
        await scraped.refresh()
        text = prometheus_client.generate_latest(scraped).decode()
        assert "deepinfer_kvcache_up 1.0" in text
        assert 'deepinfer_kvcache_tier_entries{instance="kv-split",tier="ssd"} 4.0' in text
        assert 'deepinfer_kvcache_get_hits_total{instance="kv-split"} 4.0' in text
    finally:
        await service.stop()
        await bus.drain()
    # The service is gone: /metrics still renders, and says so.
    bus = await Bus.connect(nats_url, "kvcache-split-after")
    try:
        scraped = kv_metrics.scraper(bus)
        await scraped.refresh()
        assert [f.name for f in scraped.collect()] == ["deepinfer_kvcache_up"]
        assert "deepinfer_kvcache_up 0.0" in prometheus_client.generate_latest(scraped).decode()
    finally:
        await bus.drain()


async def test_runs_past_the_pending_limit_move_in_batches_in_order(nats_server, tmp_path: Path) -> None:
    """48 MiB of blocks, more than the 32 MiB the server lets one connection have pending: batched puts and
    pipelined gets with a bounded window get every block there and back in order, with no slow consumer; a
    hole ends the run; blobs of mixed sizes (replies that fill up early) still come back whole."""
    config = KvCacheConfig(tmp_path / "kvcache", capacity_bytes=16 << 20, map_size=32 << 20, ram_bytes=96 << 20,
                           ssd_bytes=256 << 20, instance="kv-batch")
    service = KvCacheService(config)
    bus = await Bus.connect(nats_server.url, "kvcache-batch")
    try:
        await service.start(bus)
        client = KvClient(bus, message_bytes=3 * BLOCK * 4, window_bytes=2 * 3 * BLOCK * 4)
        big = 4 * BLOCK  # 1 MiB blocks, 3 a message, 2 messages in flight
        hashes = hashing.block_hashes(list(range(49 * hashing.BLOCK_TOKENS)), hashing.namespace("batch"))
        blobs = [bytes([i]) * big for i in range(48)]
        assert await client.put_many(list(zip(hashes, blobs)))
        assert client.counts["blocks_put"] == 48 and client.counts["puts_failed"] == 0
        assert await client.get_run(hashes) == blobs  # hashes[48] was never stored
        assert await client.get_run(hashes[:20] + hashes[48:] + hashes[20:]) == blobs[:20]

        # small blobs first, then big ones too: the first reply carries many, later ones fill up early
        mixed = [bytes([i]) * (2 * big if i > 10 and i % 2 else BLOCK // 4) for i in range(30)]
        keys = hashing.block_hashes(list(range(30 * hashing.BLOCK_TOKENS)), hashing.namespace("mixed"))
        assert await client.put_many(list(zip(keys, mixed)))
        assert await client.get_run(keys) == mixed
        assert "Slow Consumer" not in (nats_server.store_dir.parent / "nats.log").read_text(errors="replace")
    finally:
        await service.stop()
        await bus.drain()


async def test_same_host_workers_move_the_bytes_through_shared_memory(nats_url: str, tmp_path: Path) -> None:
    """The shm transport: blocks there and back through the worker's arena, NATS carrying lengths only; a blob
    bigger than a slot goes over NATS; a store that cannot map the arena turns the path off, and nothing is lost."""
    service = KvCacheService(KvCacheConfig(tmp_path / "kvcache", capacity_bytes=16 << 20, map_size=32 << 20,
                                           ram_bytes=64 << 20, ssd_bytes=128 << 20, ram_heap="off",
                                           instance="kv-shm"))  # the arena's path (the heap's: test_kv_heap.py)
    bus = await Bus.connect(nats_url, "kvcache-shm")
    client = open_client(bus, "shm", f"test-{os.getpid()}", message_bytes=4 * BLOCK, window_bytes=8 * BLOCK,
                         arena_bytes=32 * BLOCK)  # 8 slots of 4 blocks, 3 of them the window's reserve
    arena = client.arena
    try:
        await service.start(bus)
        assert arena is not None and arena.path.exists()
        hashes = hashing.block_hashes(list(range(21 * hashing.BLOCK_TOKENS)), hashing.namespace("shm"))
        blobs = [bytes([i]) * BLOCK for i in range(20)]
        assert await client.put_many(list(zip(hashes, blobs)))
        assert await client.get_run(hashes) == blobs
        assert client.counts["blocks_via_shm"] == 40  # 20 put, 20 got
        # a run that ends early: the chunks still in flight are dropped, their slots come back once answered
        holed = hashes[:9] + hashes[20:] + hashes[9:20]
        assert await client.get_run(holed) == blobs[:9]
        for _ in range(50):
            if arena.free_slots == 8:
                break
            await asyncio.sleep(0.05)
        assert arena.free_slots == 8 and arena.lost == 0
        big = (b"part", b"p" * (6 * BLOCK))  # bigger than a slot: over NATS, both ways
        assert await client.put_many([big], ttl_s=60.0) and await client.get_run([big[0]]) == [big[1]]
        assert client.arena is arena and arena.lost == 0 and client.counts["puts_failed"] == 0
        assert client.counts["blocks_via_shm"] >= 49  # 40 + the 9 of the holed run (cancelled chunks may add some)

        arena.token = b"another host...."  # what a store elsewhere sees: no such arena, or not this one
        more = [(b"after-%d" % i, bytes([i]) * BLOCK) for i in range(3)]
        assert await client.put_many(more)
        assert client.arena is None and client.counts["arena_refused"] == 1
        assert await client.get_run([k for k, _ in more]) == [b for _, b in more]
    finally:
        await service.stop()
        await bus.drain()
        arena.close()
    assert not arena.path.exists()


async def test_a_run_moves_engine_to_arena_to_engine_with_one_copy_each_way(nats_url: str, tmp_path: Path) -> None:
    """put_run: the engine's cache exports a run straight into arena slots (no bytes per block); get_run: the
    blobs come back as views of the slots the store wrote into, the other cache imports from them, and the slots
    come back when the views go. Without an arena the same calls go over NATS with the same bytes."""
    import torch

    from shared.engine.kv_cache import CacheSpec, KVCache, PagedSpec

    spec = CacheSpec(PagedSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16, dtype=torch.float32), 0)
    src, dst = KVCache(spec, 24, torch.device("cpu")), KVCache(spec, 24, torch.device("cpu"))
    src.kv.uniform_()
    bb = src.block_bytes  # 32 KiB
    service = KvCacheService(KvCacheConfig(tmp_path / "kvcache", capacity_bytes=16 << 20, map_size=32 << 20,
                                           ram_bytes=64 << 20, ssd_bytes=128 << 20, ram_heap="off",
                                           instance="kv-run"))
    bus = await Bus.connect(nats_url, "kvcache-run")
    client = open_client(bus, "shm", f"test-run-{os.getpid()}", message_bytes=4 * bb, window_bytes=8 * bb,
                         arena_bytes=64 * bb)  # 16 slots of 4 blocks
    plain = KvClient(bus, message_bytes=4 * bb, window_bytes=8 * bb)
    arena = client.arena
    assert arena is not None
    calls: list[int] = []

    async def export(parts: list[tuple[int, int, memoryview]]) -> None:
        calls.append(len(parts))
        for lo, hi, out in parts:
            src.export_run(list(range(lo, hi)), out)

    try:
        await service.start(bus)
        keys = hashing.block_hashes(list(range(21 * 16)), hashing.namespace("run"), 16)
        assert await client.put_run(keys[:18], export, bb)
        assert calls == [5] and client.counts["blocks_via_shm"] == 18  # 18 blocks in 5 slots, one export call
        got = await client.get_run(keys[:18])  # the whole run: no chunk left in flight (see the test above)
        assert len(got) == 18 and all(isinstance(b, memoryview) for b in got)  # views of the arena, no copy
        assert arena.free_slots == 16 - 5  # lent to the views until the engine is done with them
        dst.write_blocks(list(range(18)), got)
        assert torch.equal(dst.kv[:, :, :18], src.kv[:, :, :18])
        del got
        await asyncio.sleep(0)  # one loop turn: asyncio lets go of the last chunk's finished task there
        assert arena.free_slots == 16 and arena.lent_slots == 0

        # over NATS: the same bytes, an export call per window, blobs as bytes
        calls.clear()
        assert await plain.put_run(keys[18:21], export, bb) and calls == [1]
        back = await plain.get_run(keys[18:21])
        assert back == src.read_blocks([0, 1, 2]) and all(isinstance(b, bytes) for b in back)
    finally:
        await service.stop()
        await bus.drain()
        arena.close()
    assert not arena.path.exists()
