"""Faults under load, through the whole mesh: the kvcache service SIGKILLed while requests stream; the last
decode worker SIGKILLed (readiness says so until the launcher has it back); the prefill worker SIGKILLed in the
middle of its hand-over to decode (shared/worker/kv_peer.py), and hang-ups during hand-overs.

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
from shared.worker.kvclient import KvClient
from shared.schemas.health import HealthReply, HealthRequest
from shared.service import health_subject
from tests.integration.mesh import Mesh, pids_mentioning, start_mesh

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
STORY = " ".join(f"Line {i}: the lighthouse keeper counted {i} ships." for i in range(25))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    # KV bytes through shared memory here, to the store and on the peer hand-over (--kv-peer-transport auto, the
    # default; the e2e module runs both over NATS): a store or a prefill worker killed mid-transfer must cost the
    # shm paths nothing but misses either
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
        return -1 if stats is None else stats.tiers["ssd"].entries
    finally:
        await bus.drain()


def _service_pid(mesh: Mesh, service: str) -> int:
    (pid,) = [p for p in pids_mentioning(str(mesh.state_dir))
              if f"services.{service}".encode() in open(f"/proc/{p}/cmdline", "rb").read()]
    return pid


def _kvcache_pid(mesh: Mesh) -> int:
    return _service_pid(mesh, "kvcache")


def _handover(mesh: Mesh, role: str) -> dict[str, int]:
    return asyncio.run(_worker_health(mesh.nats_url, role))["handover"]


def test_a_conversation_hands_its_prompt_kv_from_prefill_to_decode_directly(mesh: Mesh) -> None:
    """Two turns: each turn's decode pulls the prompt's blocks it lacks from the prefill worker (not the store),
    through prefill's peer arena (one host: a descriptor over NATS, the engine imports from the mapped region),
    every hand-over ends by decode's done (sent once its engine let go of the region; none left to its lease),
    every region is free again, and the store still gets every block."""
    before = {role: _handover(mesh, role) for role in ("prefill", "decode")}
    stored_before = asyncio.run(_kv_counts(mesh.nats_url, "prefill")).get("blocks_put", 0)
    client = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="k", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": f"{STORY} How many ships on line 4?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And on line 9? " + STORY[:400]}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length")
    after = {role: _handover(mesh, role) for role in ("prefill", "decode")}
    delta = {role: {k: v - before[role].get(k, 0) for k, v in after[role].items()} for role in after}
    prompt_blocks = first.usage.prompt_tokens // 16 + second.usage.prompt_tokens // 16
    decode, prefill = delta["decode"], delta["prefill"]
    # every prompt block came from decode's own cache (the first turn's, in the second) or from the peer
    assert decode["peer_blocks"] > 0 and decode["peer_blocks"] + decode["local_blocks"] >= prompt_blocks, delta
    assert decode.get("store_blocks", 0) == decode.get("peer_failed", 0) == decode.get("peer_corrupt", 0) == 0
    assert decode["peer_blocks_shm"] == decode["peer_blocks"] and decode.get("shm_refused", 0) == 0, delta
    assert prefill["blocks_served_shm"] == decode["peer_blocks"] and prefill.get("blocks_served", 0) == 0, delta
    assert prefill["ended_done"] == 2 and prefill.get("ended_expired", 0) == 0, delta
    assert after["prefill"]["leases"] == 0 and after["prefill"]["shm_regions_held"] == 0, after
    stored = asyncio.run(_kv_counts(mesh.nats_url, "prefill")).get("blocks_put", 0) - stored_before
    assert stored > 0  # the store still gets the blocks, for later turns elsewhere
    assert "recomputing" not in (mesh.state_dir / "logs" / "decode-0.log").read_text()


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


async def _worker_health(nats_url: str, role: str) -> dict:
    bus = await Bus.connect(nats_url, "test-health")
    try:
        reply = await bus.request(health_subject(role, f"{role}-0"), HealthRequest(), HealthReply, timeout=10)
        return orjson.loads(reply.detail)
    finally:
        await bus.drain()


def test_a_storm_of_hang_ups_frees_every_block_and_redelivers_nothing(mesh: Mesh) -> None:
    """30 streams opened and dropped at once, half while queued for prefill, half once decoding: every worker
    lets go of every block within seconds, by its own report, and no work message fails into redelivery."""
    logs = {role: mesh.state_dir / "logs" / f"{role}-0.log" for role in ("prefill", "decode")}
    seen = {role: path.stat().st_size for role, path in logs.items()}

    async def hang_up(session: aiohttp.ClientSession, i: int) -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": 2000, "temperature": 0.8,
                "messages": [{"role": "user", "content": f"Story {i}: {STORY} Now tell me a much longer one."}]}
        async with session.post(f"{mesh.base_url}/v1/chat/completions", json=body) as r:
            assert r.status == 200
            if i % 2:
                async for line in r.content:  # until the first token: the request is decoding
                    if line.startswith(b"data: {"):
                        break
        # leaving the block closes the connection: the gateway cancels the request

    async def settled() -> dict[str, dict]:
        deadline = time.monotonic() + 60  # a bound on a failure, not the expectation (seconds)
        while True:
            reports = {role: await _worker_health(mesh.nats_url, role) for role in logs}
            if all(r["active"] == 0 and r["free_blocks"] == r["total_blocks"] and r["held"] == 0
                   and r["handover"].get("leases", 0) == 0 and r["handover"].get("shm_regions_held", 0) == 0
                   for r in reports.values()):
                return reports
            if time.monotonic() > deadline:
                return reports
            await asyncio.sleep(0.2)

    async def scenario() -> dict[str, dict]:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(hang_up(session, i) for i in range(30)))
        return await settled()

    expired = _handover(mesh, "prefill").get("ended_expired", 0)
    reports = asyncio.run(scenario())
    for role, report in reports.items():
        assert report["active"] == 0, (role, report)
        assert report["free_blocks"] == report["total_blocks"], (role, report)
        assert report["held"] == 0, (role, report)  # no request held in an engine: nor in prefill's hand-over
    # the hang-ups after the first token cancelled their hand-overs (or decode finished its pull): none is left
    # to its lease
    assert reports["prefill"]["handover"]["leases"] == 0, reports["prefill"]
    assert reports["prefill"]["handover"]["shm_regions_held"] == 0, reports["prefill"]  # every region free again
    assert reports["prefill"]["handover"].get("ended_expired", 0) == expired, reports["prefill"]
    time.sleep(2.0)  # a cancel that raised would nak with a 1 s delay: give it the time to show
    for role, path in logs.items():
        with path.open("rb") as f:
            f.seek(seen[role])
            written = f.read().decode(errors="replace")
        assert "redelivering" not in written and "retrying work message" not in written, written[-3000:]
    jobs = {role: report["jobs"] for role, report in reports.items()}
    assert sum(j.get("cancelled", 0) + j.get("dropped", 0) for j in jobs.values()) > 0, jobs


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


def test_a_prefill_worker_killed_right_after_the_first_token_still_gets_the_right_answer(mesh: Mesh) -> None:
    """SIGKILL the prefill worker the moment the client has its first token, in the middle of the hand-over (a
    1,500-token prompt: ~70 MB of KV to pull): decode takes what the peer did not give from the store or
    recomputes it, within its pull timeouts, and answers what a healthy mesh answers."""
    story = " ".join(f"Entry {i}: the harbour master logged {i * 3} boats." for i in range(110))
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": story + " How many boats in entry 5?"}]}
    decode_before = _handover(mesh, "decode")
    pid = _service_pid(mesh, "prefill")

    async def streamed(kill: bool) -> str:
        text = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            async with session.post(f"{mesh.base_url}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    content = "".join(c["delta"].get("content") or "" for c in orjson.loads(line[6:])["choices"])
                    if kill and content and not text:  # the first token (not the role chunk before it)
                        os.kill(pid, signal.SIGKILL)
                    text += [content] if content else []
        return "".join(text)

    killed = asyncio.run(streamed(kill=True))
    decode_after = _handover(mesh, "decode")
    assert any("prefill-0 exited" in line for line in mesh.output)
    assert _health_until(mesh, 200, 180)[0] == 200  # the launcher has a prefill worker back
    assert _service_pid(mesh, "prefill") != pid
    healthy = asyncio.run(streamed(kill=False))
    assert killed == healthy and healthy
    # the pull did not complete from the dead peer: the store or recompute filled in
    assert decode_after.get("peer_failed", 0) > decode_before.get("peer_failed", 0), (decode_before, decode_after)
