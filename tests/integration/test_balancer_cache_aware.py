"""Cache-aware prefill routing on a real nats-server: fake prefill workers heartbeat how they name KV blocks and
publish their local cache's changes; the balancer sends a repeated prompt to the worker that holds its prefix."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from services.balancer.config import BalancerConfig
from services.balancer.service import BalancerService
from shared import hashing, subjects
from shared.bus import Bus, Envelope
from tests.integration.buses import connect, until
from shared.kv_events import EventPublisher
from shared.schemas.events import OP_STORED, TIER_LOCAL
from shared.schemas.generate import GenerateRequest, PrefillJob, SamplingParams
from shared.schemas.workers import Heartbeat

MODEL = "tiny"
CACHE_ID = "tiny:llama:fp32"
BLOCK = 16


def keys(prompt: list[int]) -> list[bytes]:
    return hashing.block_hashes(prompt, hashing.namespace(CACHE_ID), BLOCK)


class FakePrefill:
    """Heartbeats every 0.1 s; on a job, "computes" the prompt (caches its full blocks) and keeps it queued."""

    def __init__(self, bus: Bus, worker_id: str) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.queued = 0
        self.cached: set[bytes] = set()
        self.jobs: list[str] = []
        self.events = EventPublisher(bus, worker_id, tick_s=0.2)
        self.task = asyncio.create_task(self._beat())

    async def start(self) -> None:
        await self.events.serve_snapshots(lambda: {TIER_LOCAL: list(self.cached)})

    async def _beat(self) -> None:
        while True:
            beat = Heartbeat(self.worker_id, "prefill", MODEL, self.queued, 0, 100, 100, time.time(),
                             cache_id=CACHE_ID, block_tokens=BLOCK)
            await self.bus.publish(subjects.HEARTBEAT, beat)
            await asyncio.sleep(0.1)

    async def take(self, job: PrefillJob, _: Envelope) -> None:
        self.jobs.append(job.request.request_id)
        new = [k for k in keys(job.request.prompt_ids) if k not in self.cached]
        self.cached.update(new)
        self.events.record(OP_STORED, TIER_LOCAL, new)
        self.queued += 100  # still busy with it as far as the balancer knows

    async def close(self) -> None:
        self.task.cancel()
        await self.events.close()


async def test_a_repeated_prompt_goes_to_the_worker_holding_its_prefix(nats_url: str) -> None:
    balancer = BalancerService(BalancerConfig(("prefill",), worker_timeout_s=1.0, route_wait_s=2.0, retry_delay_s=0.2))
    bus = await connect(nats_url, "balancer")
    side = await connect(nats_url, "fake-prefill")
    workers = {w: FakePrefill(side, w) for w in ("w1", "w2")}
    for w in workers.values():
        await w.start()
    queues = [
        await side.work_queue(subjects.prefill_work(w), f"fake-{w}", PrefillJob, fake.take)
        for w, fake in workers.items()
    ]
    placed: dict[str, str] = defaultdict(str)

    def where(rid: str) -> str:
        for w, fake in workers.items():
            if rid in fake.jobs:
                placed[rid] = w
        return placed[rid]

    async def submit(rid: str, prompt: list[int]) -> str:
        request = GenerateRequest(rid, MODEL, prompt, SamplingParams(max_tokens=4), arrival=time.time())
        await side.submit(subjects.ROUTE_PREFILL, request, msg_id=rid)
        await until(lambda: where(rid) != "", 5.0, f"{rid} to be placed")
        return where(rid)

    prompt_a = list(range(200))  # 12 full blocks and a tail
    prompt_b = list(range(1000, 1200))
    try:
        await balancer.start(bus)
        await until(lambda: balancer.registry.counts().get("prefill") == 2, 3.0, "both workers to join")

        assert await submit("a1", prompt_a) == "w1"  # cold everywhere, both idle: the smaller id
        holder = balancer.index
        await until(lambda: holder.run("w1", keys(prompt_a)).blocks == 12, 3.0, "w1's cache in the balancer's index")
        await until(lambda: balancer.registry.candidates("prefill", MODEL, time.time())[0].queued_tokens == 100,
                    3.0, "w1's queue in a heartbeat")

        # w1 is busier (100 queued tokens) but holds all 12 blocks: 200 - 192 + 100 = 108 against w2's 200.
        assert await submit("a2", prompt_a) == "w1"
        # A prompt nobody has seen goes where the queue is shorter.
        assert await submit("b1", prompt_b) == "w2"
        await until(lambda: holder.run("w2", keys(prompt_b)).blocks == 12, 3.0, "w2's cache in the index")
        assert await submit("b2", prompt_b) == "w2"
        assert balancer.stats["local_hit_tokens_prefill"] == 2 * 192
        assert balancer.index.synced("w1") and balancer.index.synced("w2")
    finally:
        for fake in workers.values():
            await fake.close()
        for queue in queues:
            await queue.stop()
        await balancer.stop()
        await bus.drain()
        await side.drain()
