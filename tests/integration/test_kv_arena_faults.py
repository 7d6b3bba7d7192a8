"""Faults on the shared-memory path (issue 11 item 5): a kvcache service hung or killed mid-transfer, a worker
killed mid-transfer, a transfer cancelled half-way. Nothing leaks: every arena slot comes back to its worker
(after the deadline it was lent under, if the store never answered), a dead worker's arena leaves /dev/shm and
the store's maps, the store's leases end; and a block is either its own bytes or missing (recomputed), never
another's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.kvcache.config import KvCacheConfig
from services.kvcache.service import KvCacheService
from shared import hashing
from shared.bus import Bus
from shared.kv_arena import GRACE_S, PREFIX, SHM_DIR, Arena, arena_path
from shared.worker.kvclient import KvClient, open_client
from shared.launch.process import die_with_parent
from tests.integration.test_kv_faults import kill, payload, start_kvcache, wait_ready

BLOCK = 96 * 1024  # payload()'s size
TIMEOUT_S = 1.0


def _exporter(keys: list[bytes]):
    """What the engine does in put_run: each block's bytes straight into the slot (here: derived from its key;
    `keys` the run put_run stores, its [lo, hi) are indices into it)."""

    async def export(parts: list[tuple[int, int, memoryview]]) -> None:
        for lo, hi, out in parts:
            for i in range(lo, hi):
                out[(i - lo) * BLOCK : (i - lo + 1) * BLOCK] = payload(keys[i])

    return export


async def _until(condition, bound_s: float = 30.0) -> None:
    """Wait for `condition()`; the bound only turns a hang into a failure."""
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


def _intact(keys: list[bytes], got: list) -> bool:
    return all(bytes(blob) == payload(key) for key, blob in zip(keys, got))


async def test_a_store_hung_then_killed_mid_transfer_costs_the_arena_nothing(nats_url: str, tmp_path: Path) -> None:
    """Slots of requests the store never answered are retired, then lent again once their deadline passed; a
    hung store that wakes up after it never writes into them (its requests are past their deadline), so the
    blocks read through the reused slots are intact; a store killed mid-put loses those puts, nothing else."""
    keys = hashing.block_hashes(list(range(64 * hashing.BLOCK_TOKENS)), hashing.namespace("arena-faults"))
    process = start_kvcache(nats_url, tmp_path, "kv-arena")
    bus = await Bus.connect(nats_url, "kv-arena-test")
    arena = Arena(arena_path(f"test-faults-{os.getpid()}"), slots=8, slot_bytes=4 * BLOCK)
    kv = KvClient(bus, timeout=TIMEOUT_S, message_bytes=4 * BLOCK, window_bytes=8 * BLOCK, arena=arena)
    try:
        await wait_ready(bus, "kv-arena", process)
        assert await kv.put_run(keys[:32], _exporter(keys), BLOCK)
        os.kill(process.pid, signal.SIGSTOP)  # hung mid-transfer: requests reach it and are never answered
        assert await kv.get_run(keys[:32]) == []  # a miss: decode recomputes
        assert not await kv.put_run(keys[32:48], _exporter(keys[32:]), BLOCK)
        assert arena.lost > 0 and arena.free_slots < 8
        await _until(lambda: arena.free_slots == 8)  # past the deadlines (+ grace): every slot lendable again
        assert arena.reclaimed == arena.lost and arena.lent_slots == 0
        for _ in range(8):  # the reused slots now hold other bytes: a late store write or read would show
            offset = arena.take()
            assert offset is not None
            arena.view(offset, arena.slot_bytes)[:] = b"\xee" * arena.slot_bytes
            arena.give(offset)
        os.kill(process.pid, signal.SIGCONT)  # it wakes and works through its stale requests: all refused
        got = await kv.get_run(keys[:32])
        assert len(got) == 32 and _intact(keys, got)
        del got
        stale = await KvClient(bus, timeout=5.0).get_run(keys[32:48])  # over NATS: what the store holds
        assert _intact(keys[32:], stale)  # the stale puts stored nothing from reused slots (most likely nothing)

        async def export_then_kill(parts: list[tuple[int, int, memoryview]]) -> None:
            await _exporter(keys[32:])(parts)
            kill(process)  # killed mid-put: the slots are filled and lent, the requests about to go

        lost = arena.lost
        assert not await kv.put_run(keys[32:64], export_then_kill, BLOCK)
        assert arena.lost > lost  # their requests found no store: the slots retired until their deadline
        await _until(lambda: arena.free_slots == 8)
        assert arena.reclaimed == arena.lost and kv.arena is arena  # the path stays on for the restarted store

        process = start_kvcache(nats_url, tmp_path, "kv-arena")
        await wait_ready(bus, "kv-arena", process)
        got = await kv.get_run(keys)
        assert len(got) >= 32 and _intact(keys, got)  # the first 32 from its SSD tier; the rest intact or missing
    finally:
        kill(process)
        await bus.drain()
        arena.close()


WORKER = """
import asyncio, sys
from shared import hashing
from shared.bus import Bus
from shared.worker.kvclient import open_client
from tests.integration.test_kv_faults import payload
from tests.integration.test_kv_arena_faults import BLOCK, _exporter

async def main(url, instance):
    bus = await Bus.connect(url, instance)
    kv = open_client(bus, "shm", instance, message_bytes=4 * BLOCK, window_bytes=8 * BLOCK, arena_bytes=64 * BLOCK)
    keys = hashing.block_hashes(list(range(4096 * hashing.BLOCK_TOKENS)), hashing.namespace("killed-worker"))
    await kv.lookup_run(keys, lease_s=60.0)
    for at in range(0, len(keys), 64):
        await kv.put_run(keys[at : at + 64], _exporter(keys[at:]), BLOCK)
        await kv.lookup_run(keys[: at + 64], lease_s=60.0)  # leased for the gets a worker would do next
        print(at, flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_worker_killed_mid_transfer_leaks_no_arena_and_no_lease(nats_url: str, tmp_path: Path) -> None:
    """A worker process (the prefill side's KvClient, through its arena) SIGKILLed while it puts a long run: the
    store's sweep removes its arena from /dev/shm and unmaps it, its leases end at their (capped) time, and
    every block the store kept is intact."""
    service = KvCacheService(KvCacheConfig(tmp_path / "kvcache", capacity_bytes=256 << 20, map_size=512 << 20,
                                           ram_bytes=64 << 20, ssd_bytes=512 << 20, sweep_interval_s=0.1,
                                           max_lease_s=1.0, instance="kv-worker-faults"))
    bus = await Bus.connect(nats_url, "kv-worker-faults")
    instance = f"test-killed-{os.getpid()}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    worker = None
    try:
        await service.start(bus)
        worker = subprocess.Popen([sys.executable, "-c", WORKER, nats_url, instance], stdout=subprocess.PIPE,
                                  env=env, preexec_fn=die_with_parent)
        assert worker.stdout is not None
        await asyncio.to_thread(worker.stdout.readline)  # a first run stored, the next one under way
        await asyncio.to_thread(worker.stdout.readline)
        assert len(service._arenas) == 1 and service.store is not None and len(service.store.leases) > 0
        kill(worker)  # mid-transfer: slots lent to the store, leases held

        mine = lambda: list(SHM_DIR.glob(f"{PREFIX}{instance}-*"))  # noqa: E731
        await _until(lambda: not mine() and len(service._arenas) == 0)  # no worker of its name came back
        await _until(lambda: service.store is not None and len(service.store.leases) == 0)
        keys = hashing.block_hashes(list(range(4096 * hashing.BLOCK_TOKENS)), hashing.namespace("killed-worker"))
        got = await KvClient(bus, timeout=5.0).get_run(keys[:256])
        assert len(got) >= 128 and _intact(keys, got)  # the runs it finished, and maybe part of the torn one
    finally:
        if worker is not None:
            kill(worker)
        await service.stop()
        await bus.drain()


async def test_a_cancel_mid_transfer_gives_every_slot_back(nats_url: str, tmp_path: Path) -> None:
    """A request cancelled while its blocks move (the client left): a put cancelled during its export and a get
    cancelled while its chunks are in flight leave no slot lent and none retired."""
    service = KvCacheService(KvCacheConfig(tmp_path / "kvcache", capacity_bytes=64 << 20, map_size=128 << 20,
                                           ram_bytes=64 << 20, ssd_bytes=128 << 20, ram_heap="off",
                                           instance="kv-cancel"))  # the arena's slots (no heap: the get is chunked)
    bus = await Bus.connect(nats_url, "kv-cancel")
    kv = open_client(bus, "shm", f"test-cancel-{os.getpid()}", message_bytes=4 * BLOCK, window_bytes=8 * BLOCK,
                     arena_bytes=32 * BLOCK)
    arena = kv.arena
    assert arena is not None and arena.slots == 8
    keys = hashing.block_hashes(list(range(96 * hashing.BLOCK_TOKENS)), hashing.namespace("cancel"))
    exporting = asyncio.Event()
    release = asyncio.Event()

    async def slow_export(parts: list[tuple[int, int, memoryview]]) -> None:  # the engine busy with a step
        exporting.set()
        await release.wait()
        await _exporter(keys)(parts)

    try:
        await service.start(bus)
        put = asyncio.create_task(kv.put_run(keys[:32], slow_export, BLOCK))
        await exporting.wait()
        assert arena.free_slots == 0  # every slot being filled
        put.cancel()
        await asyncio.sleep(0)
        assert arena.free_slots == 0  # the export still writes into them: not lendable yet
        release.set()
        await _until(lambda: arena.free_slots == 8)

        assert await kv.put_run(keys, _exporter(keys), BLOCK)
        get = asyncio.create_task(kv.get_run(keys))
        deadline = time.monotonic() + 10.0
        while kv.counts["blocks_via_shm"] <= 96:  # every loop turn: cancel right after the first chunk is back
            assert time.monotonic() < deadline and not get.done()
            await asyncio.sleep(0)
        get.cancel()
        await asyncio.gather(get, return_exceptions=True)
        assert get.cancelled()  # mid-transfer: some chunks back (views lent), more in flight
        await _until(lambda: arena.free_slots == 8)
        assert arena.lost == 0 and arena.lent_slots == 0
    finally:
        await service.stop()
        await bus.drain()
        if arena is not None:
            arena.close()
