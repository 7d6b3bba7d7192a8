"""The balancer on a real nats-server, with fake workers that heartbeat and pull their work queues."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable

import nats

from services.balancer.config import BalancerConfig
from services.balancer.service import BalancerService
from shared import subjects
from shared.bus import Bus, Envelope
from shared.schemas.balancer import LostQuery, LostReply
from shared.schemas.generate import DecodeJob, GenerateRequest, PrefillJob, SamplingParams, TokenEvent
from shared.schemas.workers import Heartbeat

MODEL = "tiny"


async def connect(url: str, name: str) -> Bus:
    # A short drain timeout: nats-py's fetch takes expired-pull status messages off an idle pull subscription
    # without task_done(), so draining a connection whose work queue sat idle > 1 s waits out the whole drain
    # timeout (30 s by default) unless WorkQueue.stop() unsubscribes its pull subscription first.
    return Bus(await nats.connect(url, name=name, drain_timeout=1), name)


class FakeWorkers:
    """Heartbeats every 0.1 s for each worker in `alive`."""

    def __init__(self, bus: Bus, role: str, free_blocks: int = 100) -> None:
        self.bus = bus
        self.role = role
        self.free_blocks = free_blocks
        self.alive: set[str] = set()
        self.task = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            for worker in sorted(self.alive):
                beat = Heartbeat(worker, self.role, MODEL, 0, 0, self.free_blocks, 100, time.time())
                await self.bus.publish(subjects.HEARTBEAT, beat)
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        self.task.cancel()


async def until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def request(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, MODEL, list(range(50)), SamplingParams(max_tokens=4), arrival=time.time())


async def test_prefill_routing_worker_loss_and_no_worker(nats_url: str) -> None:
    balancer = BalancerService(BalancerConfig(("prefill",), worker_timeout_s=1.0, route_wait_s=1.5, retry_delay_s=0.2))
    bus = await connect(nats_url, "balancer")
    side = await connect(nats_url, "fake-workers")
    jobs: dict[str, list[PrefillJob]] = defaultdict(list)
    errors: dict[str, TokenEvent] = {}

    def holder(worker: str) -> Callable[[PrefillJob, Envelope], Awaitable[None]]:
        async def take(job: PrefillJob, _: Envelope) -> None:
            jobs[worker].append(job)  # held, never reported done: a lost worker's requests must be recovered

        return take

    async def on_tokens(event: TokenEvent, _: Envelope) -> None:
        errors[event.request_id] = event

    workers = FakeWorkers(side, "prefill")
    queues = [await side.work_queue(subjects.prefill_work(w), f"fake-{w}", PrefillJob, holder(w)) for w in ("w1", "w2")]
    await side.subscribe("tokens.*", TokenEvent, on_tokens)
    try:
        await balancer.start(bus)
        workers.alive = {"w1", "w2"}
        await until(lambda: balancer.registry.counts().get("prefill") == 2, 3.0, "both workers to join")

        for i in range(6):
            await side.submit(subjects.ROUTE_PREFILL, request(f"a{i}"), msg_id=f"a{i}")
        await until(lambda: sum(map(len, jobs.values())) == 6, 5.0, "six prefill jobs")
        assert len(jobs["w1"]) >= 1 and len(jobs["w2"]) >= 1  # spread, not all on one worker
        assert all(job.worker_id == w for w in jobs for job in jobs[w])
        on_w1 = {job.request.request_id for job in jobs["w1"]}

        # w1 goes silent: it leaves the pool within the timeout and its jobs are recomputed on w2.
        workers.alive = {"w2"}
        left_after = await until(lambda: "w1" not in balancer.registry, 3.0, "w1 to leave the pool")
        assert left_after < 2.0
        await until(lambda: on_w1 <= {j.request.request_id for j in jobs["w2"]}, 3.0, "w1's jobs on w2")
        w1_count = len(jobs["w1"])
        # w1 restarting asks, before it takes a job, what moved on meanwhile: its redelivered jobs must not run
        told = await side.request(subjects.BALANCER_LOST, LostQuery("w1"), LostReply)
        assert sorted((c.request_id, c.worker_id, c.role, c.reason) for c in told.cancels) == sorted(
            (rid, "w1", "prefill", "re-routed") for rid in on_w1)
        for i in range(3):
            await side.submit(subjects.ROUTE_PREFILL, request(f"b{i}"), msg_id=f"b{i}")
        await until(lambda: sum(j.request.request_id.startswith("b") for j in jobs["w2"]) == 3, 5.0, "b jobs on w2")
        assert len(jobs["w1"]) == w1_count

        # w2 goes silent too: everything it held goes back to the recipe to resume ("lost", with a 503 for a
        # consumer that does not), and a new request fails after the wait.
        workers.alive = set()
        await until(lambda: "w2" not in balancer.registry, 3.0, "w2 to leave the pool")
        held = {j.request.request_id for j in jobs["w2"]}
        await until(lambda: held <= errors.keys(), 3.0, "worker-lost events")
        assert {(errors[r].finish_reason, errors[r].error, errors[r].error_status) for r in held} == {
            ("lost", "worker lost", 503)}
        await side.submit(subjects.ROUTE_PREFILL, request("c0"), msg_id="c0")
        await until(lambda: "c0" in errors, 5.0, "the no-worker error")
        event = errors["c0"]
        assert (event.finish_reason, event.error_status, event.error) == ("error", 503, "no prefill worker available")
        assert event.index == 0 and event.token_ids == []
    finally:
        await workers.close()
        for queue in queues:
            await queue.stop()
        await balancer.stop()
        await bus.drain()
        await side.drain()


async def test_decode_routing_picks_the_worker_with_room(nats_url: str) -> None:
    balancer = BalancerService(BalancerConfig(("decode",), worker_timeout_s=1.0, route_wait_s=1.0, retry_delay_s=0.2))
    bus = await connect(nats_url, "balancer")
    side = await connect(nats_url, "fake-decoders")
    got: list[DecodeJob] = []

    async def take(job: DecodeJob, _: Envelope) -> None:
        got.append(job)

    roomy, cramped = FakeWorkers(side, "decode", free_blocks=90), FakeWorkers(side, "decode", free_blocks=2)
    queue = await side.work_queue(subjects.decode_work("roomy"), "fake-roomy", DecodeJob, take)
    try:
        await balancer.start(bus)
        roomy.alive, cramped.alive = {"roomy"}, {"cramped"}
        await until(lambda: balancer.registry.counts().get("decode") == 2, 3.0, "decode workers to join")
        job = DecodeJob(
            request("d0"), first_token=7, block_hashes=[], snapshot_key=b"", cached_tokens=0, prefill_worker="p"
        )
        await side.submit(subjects.ROUTE_DECODE, job, msg_id="d0:handoff")
        await until(lambda: len(got) == 1, 5.0, "the decode job")
        assert got[0].worker_id == "roomy" and got[0].first_token == 7
    finally:
        await roomy.close()
        await cramped.close()
        await queue.stop()
        await balancer.stop()
        await bus.drain()
        await side.drain()


async def test_decode_demand_is_counted_in_the_models_own_blocks(nats_url: str) -> None:
    """A DeepSeek-V4 prompt of 300 tokens fills 2 full 128-token blocks (prefill hashed them) plus one for its tail
    and first token: 3 blocks fit a worker with 5 free (counted in 16-token blocks it would ask for 19 and wait)."""
    balancer = BalancerService(BalancerConfig(("decode",), worker_timeout_s=1.0, route_wait_s=1.0, retry_delay_s=0.2))
    bus = await connect(nats_url, "balancer")
    side = await connect(nats_url, "fake-decoders")
    got: list[DecodeJob] = []

    async def take(job: DecodeJob, _: Envelope) -> None:
        got.append(job)

    small = FakeWorkers(side, "decode", free_blocks=5)
    queue = await side.work_queue(subjects.decode_work("small"), "fake-small", DecodeJob, take)
    try:
        await balancer.start(bus)
        small.alive = {"small"}
        await until(lambda: balancer.registry.counts().get("decode") == 1, 3.0, "the decode worker to join")
        prompt = GenerateRequest("v4", MODEL, list(range(300)), SamplingParams(max_tokens=4), arrival=time.time())
        job = DecodeJob(prompt, first_token=7, block_hashes=[b"b0", b"b1"], snapshot_key=b"s", cached_tokens=0,
                        prefill_worker="p")
        await side.submit(subjects.ROUTE_DECODE, job, msg_id="v4:handoff")
        await until(lambda: len(got) == 1, 5.0, "the decode job")
        assert got[0].worker_id == "small"
    finally:
        await small.close()
        await queue.stop()
        await balancer.stop()
        await bus.drain()
        await side.drain()
