"""Prefill's side of the hand-over, against the real prefill handler on a tiny real engine (the bus and the KV
store are recording fakes): on the peer path the job leaves before the first token and before the store, the
KV waits in a hand-over, not in the engine; on the store path the job leaves after the store; a cancel during
the hand-over leaves nothing held anywhere."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from services.prefill.service import PrefillService
from shared import subjects
from shared.config import ServiceConfig
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.loader import LoadedModel
from shared.schemas.generate import Cancel, DecodeJob, GenerateRequest, PrefillJob, SamplingParams, TokenEvent
from shared.schemas.kv import KvLookupReply
from shared.schemas.kv_peer import KvPeerPull
from shared.worker.config import WorkerConfig
from shared.worker.kv_peer import PREFERRED
from shared.worker.kv_peer_transport import ShmExporter
from tests.unit.test_engine_tiny import checkpoint, loaded  # noqa: F401  (fixtures)
from tests.unit.test_worker_cancel import ENV

PROMPT = 40  # two full blocks of 16 and a partial one


@dataclass
class FakeBus:
    """Records what is published and submitted, in order."""

    sent: list[tuple[str, Any]] = field(default_factory=list)
    msg_ids: list[str] = field(default_factory=list)
    max_payload: int = 1 << 20

    async def publish(self, subject: str, message: Any, **kwargs: Any) -> None:
        self.sent.append((subject, message))

    async def submit(self, subject: str, message: Any, **kwargs: Any) -> None:
        self.sent.append((subject, message))
        self.msg_ids.append(kwargs["msg_id"])


class FakeKv:
    """An empty store that stores; its puts wait at a gate when one is set."""

    def __init__(self, bus: FakeBus) -> None:
        self.bus = bus
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self.keys: list[bytes] = []
        self.blobs: dict[bytes, bytes] = {}

    async def lookup_run(self, hashes: list[bytes], lease_s: float = 0.0) -> KvLookupReply:
        return KvLookupReply(hits=0)

    async def get_run(self, keys: list[bytes]) -> list[bytes]:
        return []

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return [None] * len(keys)

    async def put_many(self, items: list[tuple[bytes, bytes]], ttl_s: float = 0.0) -> bool:
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        self.bus.sent.append(("put", len(items)))
        self.keys += [key for key, _ in items]
        self.blobs.update((key, bytes(blob)) for key, blob in items)
        return True

    async def put_run(self, keys: list[bytes], export: Callable[[list[tuple[int, int, memoryview]]], Awaitable[None]],
                      block_bytes: int, ttl_s: float = 0.0) -> bool:
        """As KvClient.put_run: the engine exports the run into the client's buffer, then the store takes it."""
        buf = memoryview(bytearray(len(keys) * block_bytes))
        await export([(0, len(keys), buf)])
        return await self.put_many([(k, bytes(buf[i * block_bytes : (i + 1) * block_bytes])) for i, k in enumerate(keys)],
                                   ttl_s)


def prefill(checkpoint: Path, loaded: LoadedModel, handover: str) -> PrefillService:  # noqa: F811
    config = ServiceConfig("nats://127.0.0.1:4222", "prefill-test", Path("."), str(checkpoint))
    svc = PrefillService(config, WorkerConfig("cpu", 256, 512, 32, kv_handover=handover))
    svc.bus = FakeBus()  # type: ignore[assignment]
    svc.kv = FakeKv(svc.bus)  # type: ignore[arg-type, assignment]
    svc.use_engine(AsyncEngine(Engine(loaded, device="cpu", dtype=torch.float32, kv_blocks=256, max_running=32)))
    assert svc.engine is not None
    svc.engine.start()
    return svc


def job(rid: str) -> PrefillJob:
    return PrefillJob(GenerateRequest(rid, "m", [1 + i % 300 for i in range(PROMPT)], SamplingParams(max_tokens=8)),
                      "prefill-test")


def kinds(svc: PrefillService) -> list[str]:
    bus: FakeBus = svc.bus  # type: ignore[assignment]
    out = []
    for subject, message in bus.sent:
        out.append("job" if isinstance(message, DecodeJob) else "token" if isinstance(message, TokenEvent)
                   else subject)
    return [k for k in out if k in ("job", "token", "put")]


def decode_job(svc: PrefillService) -> DecodeJob:
    bus: FakeBus = svc.bus  # type: ignore[assignment]
    (found,) = [m for s, m in bus.sent if s == subjects.ROUTE_DECODE]
    return found


async def held(svc: PrefillService) -> int:
    assert svc.engine is not None
    await svc.engine.call(lambda: None)  # a fresh stats snapshot
    return svc.engine.stats.held


async def test_the_peer_path_hands_the_job_on_first_and_holds_bytes_not_blocks(checkpoint: Path,  # noqa: F811
                                                                               loaded: LoadedModel) -> None:  # noqa: F811
    svc = prefill(checkpoint, loaded, "peer")
    await svc._on_job(job("r1"), ENV)
    assert kinds(svc)[:2] == ["job", "token"] and "put" in kinds(svc)  # the job before the token and the store
    handoff = decode_job(svc)
    assert handoff.peer_lease_s > 0 and handoff.prefill_worker == "prefill-test" and handoff.snapshot_key
    kv: FakeKv = svc.kv  # type: ignore[assignment]
    assert handoff.snapshot_key in kv.keys  # the key the job carried is the one the snapshot was stored under
    assert await held(svc) == 0  # the engine let go: the hand-over has the bytes
    assert len(svc.handovers) == 1
    reply = await svc.handovers.serve(KvPeerPull("r1", 0, handoff.block_hashes, 1 << 30))
    assert svc.engine is not None
    block_bytes = svc.engine.layout.block_bytes
    assert reply.found and (reply.blocks, reply.tail) == (2, True)
    assert [len(i) for i in reply.items[:3]] == [block_bytes] * 3
    svc.handovers.end("r1", "done")
    assert len(svc.handovers) == 0
    await svc.engine.stop()


async def test_the_store_path_hands_the_job_on_after_the_store(checkpoint: Path,  # noqa: F811
                                                               loaded: LoadedModel) -> None:  # noqa: F811
    svc = prefill(checkpoint, loaded, "store")
    await svc._on_job(job("r2"), ENV)
    assert kinds(svc) == ["token", "put", "put", "put", "job"]  # blocks, snapshot, its anchor; then the job
    assert decode_job(svc).peer_lease_s == 0 and decode_job(svc).snapshot_key
    assert await held(svc) == 0 and len(svc.handovers) == 0
    assert svc.engine is not None
    await svc.engine.stop()


@pytest.mark.parametrize("shm", [False, True], ids=["bytes", "region"])
async def test_a_cancel_during_the_hand_over_leaves_nothing_held(checkpoint: Path,  # noqa: F811
                                                                 loaded: LoadedModel, shm: bool) -> None:  # noqa: F811
    svc = prefill(checkpoint, loaded, "peer")
    exporter = svc.handovers.exporter = ShmExporter.open(f"test-cancel-{os.getpid()}", 16 << 20) if shm else None
    kv: FakeKv = svc.kv  # type: ignore[assignment]
    kv.gate = asyncio.Event()
    task = asyncio.create_task(svc._on_job(job("r3"), ENV))
    await kv.entered.wait()  # handed on, exported, storing: a decode worker may be pulling now
    assert len(svc.handovers) == 1
    await svc._on_cancel(Cancel("r3", "client disconnected"), ENV)
    assert len(svc.handovers) == 0 and svc.handovers.counts["ended_cancelled"] == 1
    assert not (await svc.handovers.serve(KvPeerPull("r3", 0, [], 1 << 20))).found
    if exporter is not None:
        assert exporter.held == 1  # the store's put still reads the region's views
    kv.gate.set()
    await task  # settled, not failed into redelivery
    assert await held(svc) == 0 and not svc.active
    if exporter is not None:
        assert exporter.held == 0 and exporter.counts["regions"] == 1  # the put over: the region is free
        exporter.close()
    assert svc.engine is not None
    await svc.engine.stop()


async def test_on_one_host_the_hand_over_holds_a_region_not_bytes_and_the_store_gets_the_same(  # noqa: F811
        checkpoint: Path, loaded: LoadedModel) -> None:  # noqa: F811
    svc = prefill(checkpoint, loaded, "peer")
    exporter = svc.handovers.exporter = ShmExporter.open(f"test-prefill-{os.getpid()}", 16 << 20)
    all_free = exporter.free_bytes
    try:
        await svc._on_job(job("r4"), ENV)
        handover = svc.handovers._open["r4"]  # noqa: SLF001
        assert handover.region is not None and all(isinstance(i, memoryview) for i in handover.items)
        hashes = decode_job(svc).block_hashes
        described = await svc.handovers.serve(KvPeerPull("r4", 0, hashes, 1 << 30, 0, PREFERRED, ["shm"]))
        assert described.shm is not None and described.items == [] and (described.blocks, described.tail) == (2, True)
        plain = await svc.handovers.serve(KvPeerPull("r4", 0, hashes, 1 << 30))  # over NATS: the same region
        kv: FakeKv = svc.kv  # type: ignore[assignment]
        assert [bytes(i) for i in plain.items[:2]] == [kv.blobs[h] for h in hashes]  # the store's bytes, the same
        assert await held(svc) == 0 and exporter.held == 1
        del handover, plain
        svc.handovers.end("r4", "done")
        assert exporter.held == 0 and exporter.free_bytes == all_free
    finally:
        exporter.close()
        assert svc.engine is not None
        await svc.engine.stop()


async def test_a_continuation_samples_at_its_position_and_hands_over_anew(checkpoint: Path,  # noqa: F811
                                                                       loaded: LoadedModel) -> None:  # noqa: F811
    """A resumed request (migration 1, 5 tokens already streamed): prefill's token goes out at position 5, is the
    token the original run drew there (the draw is keyed by (seed, position)), and the hand-over to decode has a
    message id of its own (the original's is still in JetStream's dedup window)."""
    svc = prefill(checkpoint, loaded, "store")
    sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=77, ignore_eos=True)
    original = dataclasses.replace(job("r5").request, sampling=sampling)
    assert svc.engine is not None
    uninterrupted = [EngineRequest("w", original.prompt_ids, sampling, 6)]
    whole = (await svc.engine.call(run_to_completion, svc.engine.engine, uninterrupted))["w"]
    resumed = dataclasses.replace(original, prompt_ids=original.prompt_ids + whole[:5], output_offset=5, migration=1)
    await svc._on_job(PrefillJob(resumed, "prefill-test"), ENV)
    bus: FakeBus = svc.bus  # type: ignore[assignment]
    (event,) = [m for s, m in bus.sent if isinstance(m, TokenEvent)]
    assert (event.index, event.token_ids, event.migration, event.finish_reason) == (5, [whole[5]], 1, None)
    assert decode_job(svc).request.output_offset == 5
    assert bus.msg_ids == ["r5:handoff:m1"]
    await svc.engine.stop()


@pytest.mark.parametrize("shm", [False, True], ids=["bytes", "region"])
async def test_a_lost_decode_workers_hand_over_ends_at_the_balancers_word_not_its_lease(  # noqa: F811
        checkpoint: Path, loaded: LoadedModel, shm: bool) -> None:  # noqa: F811
    """The decode worker given the job died before it pulled: the balancer's Cancel for that worker (sent with the
    request's "lost" event) ends the hand-over at once, and the arena region is free once the store's put is over.
    A Cancel for another prefill worker, or for the decode worker of an earlier migration, leaves it."""
    svc = prefill(checkpoint, loaded, "peer")
    exporter = svc.handovers.exporter = ShmExporter.open(f"test-lost-{os.getpid()}", 16 << 20) if shm else None
    kv: FakeKv = svc.kv  # type: ignore[assignment]
    kv.gate = asyncio.Event()
    resumed = dataclasses.replace(job("r6").request, migration=1)
    task = asyncio.create_task(svc._on_job(PrefillJob(resumed, "prefill-test"), ENV))
    await kv.entered.wait()  # handed on, exported, storing: the hand-over waits for its decode worker
    await svc._on_cancel(Cancel("r6", "re-routed", worker_id="prefill-9", migration=1, role="prefill"), ENV)
    await svc._on_cancel(Cancel("r6", "worker lost", worker_id="decode-0", migration=0, role="decode"), ENV)
    assert len(svc.handovers) == 1  # neither was about this hand-over's decode worker
    await svc._on_cancel(Cancel("r6", "worker lost", worker_id="decode-1", migration=1, role="decode"), ENV)
    assert len(svc.handovers) == 0 and svc.handovers.counts["ended_decode_lost"] == 1
    assert not svc.cancelled("r6")  # the request itself goes on (a continuation): only the hand-over went
    kv.gate.set()
    await task
    assert await held(svc) == 0 and not svc.active
    if exporter is not None:
        assert exporter.held == 0  # the region is free again
        exporter.close()
    assert svc.handover_counts()["leases"] == 0
    assert svc.engine is not None
    await svc.engine.stop()
