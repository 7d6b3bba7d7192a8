"""KV events over a real nats-server: a consumer that misses events resynchronises from a snapshot to an exact
index, and an engine-like cache changed on its own thread stays exactly mirrored. (tests/unit/test_kv_events.py
is the broker-free half; the basenames differ because the test folders are not packages.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.balancer.kv_feed import KvEventFeed
from services.balancer.prefix_index import PrefixIndex
from shared.bus import Bus
from tests.integration.buses import connect, until
from shared.engine.block_manager import BlockManager
from shared.kv_events import EventPublisher
from shared.schemas.events import OP_REMOVED, OP_STORED, TIER_LOCAL, TIER_RAM, TIER_SSD, KvEvent

KEYS = [i.to_bytes(16, "big") for i in range(400)]


class LossyBus:
    """A bus that loses the KV events whose seq is in `drop` (as a slow consumer or a reconnect would)."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self.drop: set[int] = set()
        self.dropped = 0

    async def publish(self, subject: str, message: Any, **kwargs: Any) -> None:
        if isinstance(message, KvEvent) and message.seq in self.drop and message.op != "tick":
            self.dropped += 1
            return
        await self._bus.publish(subject, message, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bus, name)


async def test_a_consumer_that_misses_events_resyncs_to_an_exact_index(nats_url: str) -> None:
    source_bus = await connect(nats_url, "kvcache")
    router_bus = await connect(nats_url, "balancer")
    lossy = LossyBus(source_bus)
    held: dict[str, set[bytes]] = {TIER_RAM: set(), TIER_SSD: set()}  # the store's truth
    publisher = EventPublisher(lossy, "kv0", tick_s=0.1, page_hashes=64)  # type: ignore[arg-type]
    await publisher.serve_snapshots(lambda: held)
    feed = KvEventFeed(router_bus, PrefixIndex())  # type: ignore[arg-type]
    await feed.start()

    def change(op: str, tier: str, keys: list[bytes]) -> None:
        (held[tier].update if op == OP_STORED else held[tier].difference_update)(keys)
        publisher.record(op, tier, keys)

    def exact() -> bool:
        got = feed.index.holdings("kv0")
        return feed.index.synced("kv0") and all(got.get(t, set()) == held[t] for t in held)

    try:
        # Already full before anyone listened (a store reopened from disk): the first tick brings a snapshot.
        for at in range(0, 200, 20):
            change(OP_STORED, TIER_SSD, KEYS[at : at + 20])
        await until(exact, 3.0, "the first snapshot")
        assert feed.stats["resyncs"] == 1

        # Lose two events in the middle of a stream of changes.
        seq = feed.index.seq("kv0")
        lossy.drop = {seq + 2, seq + 3}
        for at in range(0, 100, 10):
            change(OP_STORED, TIER_RAM, KEYS[at : at + 10])  # promoted to RAM
            await asyncio.sleep(0.01)
            change(OP_REMOVED, TIER_SSD, KEYS[at + 100 : at + 105])  # evicted from disk
            await asyncio.sleep(0.01)
        await until(lambda: lossy.dropped == 2, 3.0, "the events to be lost")
        await until(exact, 3.0, "a resync after the gap")
        assert feed.stats["gaps"] >= 1 and feed.stats["resyncs"] == 2

        # Lose the very last change: only the source's idle tick can reveal it.
        lossy.drop = {feed.index.seq("kv0") + 1}
        change(OP_STORED, TIER_SSD, KEYS[300:310])
        await until(lambda: lossy.dropped == 3, 3.0, "the last event to be lost")
        await until(exact, 3.0, "a resync after a tick")
        assert feed.stats["resyncs"] == 3
        assert feed.index.run("kv0", KEYS[:120]).by_tier() == {TIER_RAM: 100}
    finally:
        await feed.stop()
        await publisher.close()
        await source_bus.drain()
        await router_bus.drain()


async def test_an_engine_cache_changed_on_its_own_thread_is_mirrored_exactly(nats_url: str) -> None:
    """The worker's wiring: the block manager's listener runs on the engine thread, snapshots are taken there too
    (between steps), and the router that joins halfway through still ends up with exactly the cached hashes."""
    worker_bus = await connect(nats_url, "prefill-x")
    router_bus = await connect(nats_url, "balancer")
    engine_thread = ThreadPoolExecutor(max_workers=1)
    loop = asyncio.get_running_loop()

    async def call(fn: Callable[..., Any], *args: Any) -> Any:
        return await loop.run_in_executor(engine_thread, fn, *args)

    blocks = BlockManager(num_blocks=64, block_tokens=16)
    publisher = EventPublisher(worker_bus, "prefill-x", tick_s=0.1)
    blocks.listener = lambda op, hashes: publisher.record(op, TIER_LOCAL, hashes)
    await publisher.serve_snapshots(lambda: {TIER_LOCAL: blocks.cached_hashes()}, run=call)

    def serve_prompt(i: int) -> None:  # one "request": cache 8 blocks, then release them (they stay cached)
        table = blocks.allocate(8)
        assert table is not None
        for j, block in enumerate(table):
            blocks.publish(block, KEYS[(8 * i + j) % len(KEYS)])
        blocks.free(table)

    feed = KvEventFeed(router_bus, PrefixIndex())
    try:
        for i in range(10):
            await call(serve_prompt, i)
        await feed.start()  # joins late: its first event or tick is a gap, filled by a snapshot
        for i in range(10, 40):
            await call(serve_prompt, i)
            await asyncio.sleep(0.005)
        cached = set(await call(blocks.cached_hashes))
        assert len(cached) == 64
        await until(lambda: feed.index.holdings("prefill-x") == {TIER_LOCAL: cached}, 3.0, "an exact mirror")
        assert feed.index.synced("prefill-x") and feed.stats["resyncs"] >= 1
    finally:
        await feed.stop()
        await publisher.close()
        engine_thread.shutdown()
        await worker_bus.drain()
        await router_bus.drain()
