"""Faults under load, through the whole mesh: the kvcache service SIGKILLed while requests stream; the last
decode worker SIGKILLed (readiness says so until the launcher has it back).

The store is an optimisation, never a dependency: prefill and decode read a dead store as misses and recompute,
so no request fails; the launcher restarts the service (as compose's `restart: unless-stopped` would), and its
long-term tier comes back from disk with every block it had.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest

from shared.bus import Bus
from shared.kv_arena import PREFIX, SHM_DIR
from shared.kvclient import KvClient
from shared.schemas.workers import HealthReply, HealthRequest
from shared.service import health_subject
from tests.integration.mesh import Mesh, pids_mentioning, start_mesh

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
STORY = " ".join(f"Line {i}: the lighthouse keeper counted {i} ships." for i in range(25))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    # KV bytes through shared memory here (the e2e module runs them over NATS): a store killed mid-transfer must
    # cost the shm path nothing but misses either
    mesh = start_mesh(tmp_path_factory.mktemp("faults"), env={"DEEPINFER_KV_TRANSPORT": "shm"})
    yield mesh
    mesh.stop()
    # Every worker removed its arena on the way out (the workers cleared dead ones of their names at start, so a
    # dead process's arena left now is one of this mesh's).
    left = [p for p in SHM_DIR.glob(f"{PREFIX}*-0-*") if not Path(f"/proc/{p.name.rsplit('-', 1)[1]}").exists()]
    assert left == []


async def _kv_counts(nats_url: str, role: str) -> dict[str, int]:
    bus = await Bus.connect(nats_url, "test-health")
    try:
        reply = await bus.request(health_subject(role, f"{role}-0"), HealthRequest(), HealthReply, timeout=10)
        return orjson.loads(reply.detail)["kv"]
    finally:
        await bus.drain()


async def _long_term_entries(nats_url: str) -> int:
    bus = await Bus.connect(nats_url, "test-stats")
    try:
        stats = await KvClient(bus, timeout=2.0).stats()
        return -1 if stats is None else sum(t.entries for t in stats.tiers if t.tier == "ssd")
    finally:
        await bus.drain()


def _service_pid(mesh: Mesh, service: str) -> int:
    (pid,) = [p for p in pids_mentioning(str(mesh.state_dir))
              if f"services.{service}".encode() in open(f"/proc/{p}/cmdline", "rb").read()]
    return pid


def _kvcache_pid(mesh: Mesh) -> int:
    return _service_pid(mesh, "kvcache")


def test_killing_the_kvcache_service_under_load_fails_no_request(mesh: Mesh) -> None:
    client = openai.AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key="k", max_retries=0, timeout=120)

    async def ask(i: int) -> str:
        r = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"{STORY} Question {i}: how many ships?"}],
            max_tokens=24, temperature=0)
        return r.choices[0].finish_reason

    async def scenario() -> list[str]:
        first = await asyncio.gather(*(ask(i) for i in range(3)))  # warm: blocks reach the store
        stored = await _long_term_entries(mesh.nats_url)
        assert stored > 0, stored
        pid = _kvcache_pid(mesh)
        tasks = [asyncio.create_task(ask(i)) for i in range(3, 9)]
        await asyncio.sleep(0.3)
        os.kill(pid, signal.SIGKILL)  # mid-flight: lookups, gets and puts now time out or fail
        rest = await asyncio.gather(*tasks)
        # the launcher restarts it; its SSD tier comes back with what it held
        deadline = time.monotonic() + 60
        while (entries := await _long_term_entries(mesh.nats_url)) < stored and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert entries >= stored
        assert _kvcache_pid(mesh) != pid
        return first + rest

    reasons = asyncio.run(scenario())
    assert len(reasons) == 9 and all(r in ("stop", "length") for r in reasons)
    for role in ("prefill", "decode"):  # the bytes went through shared memory
        assert asyncio.run(_kv_counts(mesh.nats_url, role)).get("blocks_via_shm", 0) > 0, role
    assert any("kvcache-0 exited" in line for line in mesh.output)


def _health_until(mesh: Mesh, status: int, timeout: float) -> tuple[int, dict]:
    """Poll /health (as a load balancer would) until it answers `status`; the last answer."""

    async def poll() -> tuple[int, dict]:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(f"{mesh.base_url}/health") as r:
                    answer = r.status, await r.json()
                if answer[0] == status or time.monotonic() > deadline:
                    return answer
                await asyncio.sleep(0.2)

    return asyncio.run(poll())


def test_readiness_follows_the_last_decode_worker(mesh: Mesh) -> None:
    assert _health_until(mesh, 200, 30) == (200, {"status": "ok"})
    pid = _service_pid(mesh, "decode")
    os.kill(pid, signal.SIGKILL)
    status, body = _health_until(mesh, 503, 30)  # within the heartbeat timeout
    assert (status, body) == (503, {"status": "not ready", "missing": [f"a decode worker for {MODEL}"]})
    assert _health_until(mesh, 200, 180) == (200, {"status": "ok"})  # restarted by the launcher, model loaded
    assert _service_pid(mesh, "decode") != pid
    client = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="k", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert any("decode-0 exited" in line for line in mesh.output)
