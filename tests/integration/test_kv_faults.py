"""The kvcache service as a real process (`python -m services.kvcache`) on a real nats-server, killed with SIGKILL
while a writer is putting blocks, then restarted on the same state dir; and what its clients see while it is gone
or hung: a miss within their timeout, never an error."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shared import hashing
from shared.bus import Bus, BusTimeout
from shared.worker.kvclient import KvClient
from shared.launch.process import die_with_parent
from shared.schemas.health import HealthReply, HealthRequest
from shared.kv_heap import remove_stale as remove_stale_heaps
from shared.service import health_subject

MiB = 1 << 20
BLOCK = 96 * 1024
BLOCKS = 600


def start_kvcache(nats_url: str, state_dir: Path, instance: str) -> subprocess.Popen[bytes]:
    log = open(state_dir / f"{instance}-{time.monotonic_ns()}.log", "wb")
    argv = [
        sys.executable, "-m", "services.kvcache", "--nats-url", nats_url, "--state-dir", str(state_dir),
        "--instance", instance, "--ram-bytes", str(4 * MiB), "--ssd-bytes", str(256 * MiB),
        "--ssd-segment-bytes", str(2 * MiB), "--capacity-bytes", str(32 * MiB), "--map-size", str(64 * MiB),
    ]  # fmt: skip
    try:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    finally:
        log.close()
    _instances[process.pid] = instance
    return process


_instances: dict[int, str] = {}  # started stores' instance names, by pid


async def wait_ready(bus: Bus, instance: str, process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"kvcache exited with {process.returncode}"
        try:
            reply = await bus.request(health_subject("kvcache", instance), HealthRequest(), HealthReply, timeout=0.5)
            if reply.ready:
                return
        except BusTimeout:
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{instance} not ready in {timeout} s")


def payload(key: bytes) -> bytes:
    """A block's bytes, derived from its key: a read is intact exactly when it equals this."""
    return hashlib.shake_128(key).digest(BLOCK)


def kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    if (instance := _instances.pop(process.pid, None)) is not None:
        remove_stale_heaps(instance)  # a killed store's shared heap (the next store of its name would remove it)


async def test_sigkill_mid_write_then_restart_keeps_every_stored_block(nats_url: str, tmp_path: Path) -> None:
    keys = hashing.block_hashes(list(range(BLOCKS * hashing.BLOCK_TOKENS)), hashing.namespace("faults"))
    process = start_kvcache(nats_url, tmp_path, "kv-fault")
    bus = await Bus.connect(nats_url, "kv-fault-test")
    try:
        await wait_ready(bus, "kv-fault", process)
        kv = KvClient(bus, timeout=2.0)
        assert await kv.put_many([(b"tail:before", b"short-term")], ttl_s=120.0)
        stored: set[bytes] = set()
        sent: set[bytes] = set()
        killed = asyncio.Event()

        async def writer(share: list[bytes]) -> None:
            for key in share:
                sent.add(key)
                if await kv.put_many([(key, payload(key))]):
                    stored.add(key)

        async def killer() -> None:
            while len(stored) < BLOCKS // 3:
                await asyncio.sleep(0.005)
            kill(process)  # eight puts in flight: some were written, some torn, some never arrived
            killed.set()

        await asyncio.gather(killer(), *(writer(keys[i::8]) for i in range(8)))
        assert BLOCKS // 3 <= len(stored) < BLOCKS and len(sent) == BLOCKS

        process = start_kvcache(nats_url, tmp_path, "kv-fault")
        await wait_ready(bus, "kv-fault", process)
        found = 0
        for at in range(0, BLOCKS, 8):
            batch = keys[at : at + 8]
            for key, blob in zip(batch, await kv.get_many(batch)):
                if key in stored:
                    assert blob == payload(key), "a block stored before the kill is missing or damaged"
                else:
                    assert blob is None or blob == payload(key), "a block in flight at the kill came back damaged"
                found += blob is not None
        assert found >= len(stored)
        assert await kv.get_many([b"tail:before"]) == [b"short-term"]  # LMDB's short-term entries survive too
        stats = await kv.stats()
        assert stats is not None
        ssd = stats.tiers["ssd"]
        assert ssd.entries == found and ssd.hits == found  # RAM started empty: every hit came from the SSD tier
    finally:
        kill(process)
        await bus.drain()


async def test_a_dead_or_hung_store_is_a_miss_within_the_timeout(nats_url: str, tmp_path: Path) -> None:
    keys = hashing.block_hashes(list(range(4 * hashing.BLOCK_TOKENS)), hashing.namespace("gone"))
    process = start_kvcache(nats_url, tmp_path, "kv-gone")
    bus = await Bus.connect(nats_url, "kv-gone-test")
    try:
        await wait_ready(bus, "kv-gone", process)
        kv = KvClient(bus, timeout=0.5)
        assert await kv.put_many([(k, payload(k)) for k in keys])
        assert await kv.lookup(keys) == 4

        os.kill(process.pid, signal.SIGSTOP)  # hung: the requests reach no one who answers
        started = time.monotonic()
        assert await kv.lookup(keys) == 0
        assert (await kv.lookup_run(keys, lease_s=5.0)).hits == 0
        assert await kv.get_run(keys) == []
        assert await kv.get_many(keys[:2]) == [None, None]
        assert not await kv.put_many([(keys[0], b"x")])
        assert await kv.stats() is None
        assert time.monotonic() - started < 6 * 0.5 + 1.0  # each call gave up at its timeout

        kill(process)  # gone: no responders, the miss is immediate
        started = time.monotonic()
        assert await kv.lookup(keys) == 0 and await kv.get_run(keys) == []
        assert time.monotonic() - started < 0.5
    finally:
        kill(process)
        await bus.drain()
