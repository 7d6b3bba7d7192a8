"""A worker's cancels, against the real decode handler on a tiny real engine (the bus and the KV store are
recording fakes): a flood of cancels is one engine call, a cancel during the KV store ends the job cleanly and
frees its blocks, and a job for a request that already ended is settled without running.

The tester saw the opposite: 20 hang-ups reaching prefill one step apart, cancels during `store_kv` raising into
redelivery, and redelivered jobs running for clients long gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from services.decode.service import DecodeService
from shared import subjects
from shared.bus import Envelope, Retry
from shared.config import ServiceConfig
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import Engine
from shared.engine.loader import LoadedModel
from shared.schemas.balancer import LostReply
from shared.schemas.generate import EVERY_WORKER, Cancel, DecodeJob, GenerateRequest, SamplingParams, TokenEvent
from shared.worker.config import WorkerConfig
from tests.unit.test_engine_tiny import checkpoint, loaded  # noqa: F401  (fixtures)

ENV = Envelope("x", None)  # type: ignore[arg-type]


@dataclass
class FakeBus:
    published: list[tuple[str, Any]] = field(default_factory=list)
    max_payload: int = 1 << 20

    lost: list[Cancel] = field(default_factory=list)  # the balancer's answer on balancer.lost
    asked: list[str] = field(default_factory=list)

    async def publish(self, subject: str, message: Any, **kwargs: Any) -> None:
        self.published.append((subject, message))

    async def request(self, subject: str, message: Any, reply_type: type, **kwargs: Any) -> Any:
        assert subject == subjects.BALANCER_LOST and reply_type is LostReply
        self.asked.append(message.worker_id)
        return LostReply(list(self.lost))


class FakeKv:
    """Holds nothing; its puts wait at a gate when one is set, so a test can cancel in the middle of a store."""

    def __init__(self) -> None:
        self.puts: list[list[bytes]] = []
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self.fail_gets = 0  # the next gets that fail (the store unreachable)

    async def get_run(self, hashes: list[bytes]) -> list[bytes]:
        if self.fail_gets:
            self.fail_gets -= 1
            raise ConnectionError("store unreachable")
        return []

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return [None] * len(keys)

    async def put_many(self, items: list[tuple[bytes, bytes]], ttl_s: float | None = None) -> None:
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        self.puts.append([key for key, _ in items])

    async def put_run(self, keys: list[bytes], export: Any, block_bytes: int, ttl_s: float = 0.0) -> bool:
        """As KvClient.put_run: the engine exports the run first, then the store takes its time."""
        await export([(0, len(keys), memoryview(bytearray(len(keys) * block_bytes)))])
        await self.put_many([(key, b"") for key in keys], ttl_s)
        return True


def worker(checkpoint: Path, loaded: LoadedModel) -> DecodeService:  # noqa: F811
    config = ServiceConfig("nats://127.0.0.1:4222", "decode-test", Path("."), str(checkpoint))
    svc = DecodeService(config, WorkerConfig("cpu", 256, 512, 32))
    svc.bus = FakeBus()  # type: ignore[assignment]
    svc.kv = FakeKv()  # type: ignore[assignment]
    svc.use_engine(AsyncEngine(Engine(loaded, device="cpu", dtype=torch.float32, kv_blocks=256, max_running=32)))
    assert svc.engine is not None
    svc.engine.start()
    return svc


def job(rid: str, max_tokens: int, prompt: int = 40) -> DecodeJob:
    request = GenerateRequest(rid, "m", [1 + i % 300 for i in range(prompt)], SamplingParams(max_tokens=max_tokens))
    return DecodeJob(request, first_token=7, block_hashes=[], snapshot_key=b"", cached_tokens=0, prefill_worker="p")


def tokens_of(svc: DecodeService, rid: str) -> int:
    """Output positions published for `rid` (prefill's token, which decode sends again, counts once)."""
    bus: FakeBus = svc.bus  # type: ignore[assignment]
    return len({m.index + k for s, m in bus.published if s == subjects.tokens(rid) and isinstance(m, TokenEvent)
                for k in range(len(m.token_ids))})


async def free_blocks(svc: DecodeService) -> tuple[int, int]:
    assert svc.engine is not None
    await svc.engine.call(lambda: None)  # a fresh stats snapshot
    return svc.engine.stats.free_blocks, svc.engine.stats.total_blocks


async def test_a_flood_of_cancels_is_one_engine_call_and_frees_every_block(checkpoint: Path,  # noqa: F811
                                                                         loaded: LoadedModel) -> None:  # noqa: F811
    svc = worker(checkpoint, loaded)
    assert svc.engine is not None
    batches: list[list[str]] = []
    abort_many = svc.engine.abort_many

    async def recording(ids: list[str]) -> None:
        batches.append(sorted(ids))
        await abort_many(ids)

    svc.engine.abort_many = recording  # type: ignore[method-assign]
    rids = [f"r{i:02d}" for i in range(30)]
    tasks = [asyncio.create_task(svc._on_job(job(rid, max_tokens=200), ENV)) for rid in rids]
    while not all(tokens_of(svc, rid) > 1 for rid in rids):  # every one is generating
        await asyncio.sleep(0.01)
    for rid in rids:
        await svc._on_cancel(Cancel(rid, "client disconnected"), ENV)
    await asyncio.gather(*tasks)  # none raised: a cancelled job is settled, not failed into redelivery
    assert batches == [rids]  # all thirty aborted together, between two steps
    assert all(tokens_of(svc, rid) < 200 for rid in rids)
    assert svc.jobs == {"run": 30, "cancelled": 30}
    free, total = await free_blocks(svc)
    assert free == total and not svc.active
    await svc.engine.stop()


async def test_a_cancel_during_the_kv_store_ends_the_job_cleanly(checkpoint: Path,  # noqa: F811
                                                                 loaded: LoadedModel) -> None:  # noqa: F811
    svc = worker(checkpoint, loaded)
    assert svc.engine is not None
    kv: FakeKv = svc.kv  # type: ignore[assignment]
    kv.gate = asyncio.Event()
    task = asyncio.create_task(svc._on_job(job("r1", max_tokens=4), ENV))
    await kv.entered.wait()  # the output is done; its full blocks are on their way to the store
    await svc._on_cancel(Cancel("r1", "client disconnected"), ENV)
    assert svc._aborter is not None
    await svc._aborter  # the engine let go of the held request under the store
    kv.gate.set()
    await task  # no exception: the message is acked, not redelivered
    assert len(kv.puts) == 1  # the full blocks (valid KV), and no snapshot of a request that is gone
    assert svc.jobs == {"run": 1, "cancelled": 1}
    free, total = await free_blocks(svc)
    assert free == total
    await svc.engine.stop()


async def test_a_job_for_a_request_that_ended_is_dropped_unrun(checkpoint: Path,  # noqa: F811
                                                               loaded: LoadedModel) -> None:  # noqa: F811
    svc = worker(checkpoint, loaded)
    assert svc.engine is not None
    await svc._on_cancel(Cancel("early", "client disconnected"), ENV)  # overtook its job
    await svc._on_cancel(Cancel("done", "re-routed", worker_id="decode-other"), ENV)  # another worker's to drop
    await svc._on_job(job("early", max_tokens=4), ENV)
    await svc._on_job(job("done", max_tokens=4), ENV)
    await svc._on_job(job("done", max_tokens=4), ENV)  # redelivered after it finished
    assert tokens_of(svc, "early") == 0 and tokens_of(svc, "done") == 4  # prefill's first and 3 more
    assert svc.jobs == {"run": 1, "dropped": 2}
    await svc.engine.stop()


async def test_a_restarted_worker_hears_what_moved_on_before_its_redelivered_jobs(checkpoint: Path,  # noqa: F811
                                                                                  loaded: LoadedModel) -> None:  # noqa: F811
    """JetStream redelivers a dead process's jobs to its restart once their ack wait is over, at once after a slow
    start: the balancer's Cancels for them are asked for before the first job, not heard with the first
    heartbeat (a race the redelivery won in CI: a stale prefill then held a hand-over nobody pulled)."""
    svc = worker(checkpoint, loaded)
    assert svc.engine is not None
    bus: FakeBus = svc.bus  # type: ignore[assignment]
    bus.lost = [Cancel("moved", "worker lost", worker_id="decode-test", migration=0, role="decode")]
    await svc._hear_lost()
    assert bus.asked == ["decode-test"]
    await svc._on_job(job("moved", max_tokens=4), ENV)  # the redelivery: dropped unrun
    await svc._on_job(job("fresh", max_tokens=4), ENV)
    assert tokens_of(svc, "moved") == 0 and tokens_of(svc, "fresh") == 4
    assert svc.jobs == {"run": 1, "dropped": 1}
    await svc.engine.stop()


async def test_a_job_that_failed_is_not_an_end_its_redelivery_runs(checkpoint: Path,  # noqa: F811
                                                                   loaded: LoadedModel) -> None:  # noqa: F811
    svc = worker(checkpoint, loaded)
    assert svc.engine is not None
    kv: FakeKv = svc.kv  # type: ignore[assignment]
    kv.fail_gets = 1
    with pytest.raises(ConnectionError):  # the bus naks it: redelivered
        await svc._on_job(job("r1", max_tokens=4), ENV)
    await svc._on_job(job("r1", max_tokens=4), ENV)
    assert tokens_of(svc, "r1") == 4
    assert svc.jobs == {"run": 2}
    await svc.engine.stop()


async def test_an_engine_failure_answers_the_client_with_a_500_at_once(checkpoint: Path,  # noqa: F811
                                                                      loaded: LoadedModel) -> None:  # noqa: F811
    """A step that fails under a request ends it explicitly: an error event (500) on its token stream, the job
    settled (not redelivered to fail again), the request remembered as ended; the next job runs normally."""
    svc = worker(checkpoint, loaded)
    assert svc.engine is not None
    real_step = svc.engine.engine.step
    calls = 0

    def failing_step() -> list:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("CUDA out of memory")
        return real_step()

    svc.engine.engine.step = failing_step  # type: ignore[method-assign]
    await asyncio.wait_for(svc._on_job(job("r1", max_tokens=4), ENV), timeout=60)
    bus: FakeBus = svc.bus  # type: ignore[assignment]
    errors = [m for s, m in bus.published if s == subjects.tokens("r1") and isinstance(m, TokenEvent) and m.error]
    assert len(errors) == 1 and errors[0].error_status == 500 and "CUDA out of memory" in errors[0].error
    assert "r1" in svc._ended  # a redelivery of its job is dropped, not run again
    await asyncio.wait_for(svc._on_job(job("r2", max_tokens=4), ENV), timeout=60)
    assert tokens_of(svc, "r2") == 4
    await svc.engine.stop()


def emitted(svc: DecodeService, rid: str) -> dict[int, list[int]]:
    """Output position -> the tokens published there for `rid`."""
    bus: FakeBus = svc.bus  # type: ignore[assignment]
    return {m.index: m.token_ids for s, m in bus.published
            if s == subjects.tokens(rid) and isinstance(m, TokenEvent) and m.token_ids}


def continuation(original: DecodeJob, output: list[int], k: int, migration: int = 1) -> DecodeJob:
    """What the mesh hands decode after a loss at output position k: the prompt plus the k tokens the client has,
    and output[k] as the token prefill sampled for position k."""
    request = dataclasses.replace(original.request, prompt_ids=[*original.request.prompt_ids, *output[:k]],
                                  output_offset=k, migration=migration)
    return dataclasses.replace(original, request=request, first_token=output[k])


async def test_a_continuation_makes_the_tokens_the_lost_run_would_have(checkpoint: Path,  # noqa: F811
                                                                        loaded: LoadedModel) -> None:  # noqa: F811
    """Seeded sampling (and a repetition penalty, which looks at every token so far) resumed at output position 9
    from the prompt and the tokens streamed: the same tokens at the same positions as the uninterrupted run."""
    svc = worker(checkpoint, loaded)
    assert svc.engine is not None
    # min_tokens = max_tokens: no stop id can end it early (stop ids masked by output position, continued too)
    sampling = SamplingParams(max_tokens=24, temperature=0.9, seed=1234, repetition_penalty=1.3, min_tokens=24)
    whole = dataclasses.replace(job("w", 24), request=dataclasses.replace(job("w", 24).request, sampling=sampling))
    await svc._on_job(whole, ENV)
    positions = emitted(svc, "w")
    output = [t for i in sorted(positions) for t in positions[i]]
    assert output[0] == whole.first_token
    assert len(output) == 24
    resumed = continuation(dataclasses.replace(whole, request=dataclasses.replace(whole.request, request_id="c")),
                           output, 9)
    await svc._on_job(resumed, ENV)
    again = emitted(svc, "c")
    assert min(again) == 9  # after the client's 9 tokens: prefill's 10th (sent again), then decode's own
    assert [t for i in sorted(again) for t in again[i]] == output[9:]
    await svc.engine.stop()


@pytest.mark.parametrize("addressed", ["decode-test", EVERY_WORKER], ids=["this-worker", "every-worker"])
async def test_a_lost_migration_is_let_go_and_its_continuation_runs_on_the_same_worker(  # noqa: F811
        checkpoint: Path, loaded: LoadedModel, addressed: str) -> None:  # noqa: F811
    """The balancer took this worker for lost (or a recipe took over a request whose recipe died: a Cancel for
    every worker): its Cancel for migration 0 drops the redelivered migration-0 job (the restarted worker must not
    run it for nobody) but not the request's continuation placed here later; a continuation that comes while
    migration 0 still runs waits (Retry) for the abort; a plain Cancel (the client left) ends every migration."""
    svc = worker(checkpoint, loaded)
    assert svc.engine is not None
    first = job("r1", max_tokens=400)
    running = asyncio.create_task(svc._on_job(first, ENV))
    while not emitted(svc, "r1"):
        await asyncio.sleep(0.01)
    resumed = continuation(first, [7] * 20, 3)
    with pytest.raises(Retry):  # migration 0 is still in the engine: the same id cannot go in twice
        await svc._on_job(resumed, ENV)
    await svc._on_cancel(Cancel("r1", "worker lost", worker_id=addressed, migration=0), ENV)
    await running  # aborted, settled
    await svc._on_job(first, ENV)  # redelivered migration 0: dropped
    assert svc.jobs == {"run": 1, "cancelled": 1, "dropped": 1}
    short = dataclasses.replace(resumed, request=dataclasses.replace(
        resumed.request, sampling=SamplingParams(max_tokens=8, seed=3, ignore_eos=True)))
    bus: FakeBus = svc.bus  # type: ignore[assignment]
    before = len(bus.published)
    await svc._on_job(short, ENV)  # the continuation runs here: positions 3 (prefill's, again) .. 7
    assert svc.jobs["run"] == 2
    events = [m for _, m in bus.published[before:] if isinstance(m, TokenEvent)]
    assert [i for m in events for i in range(m.index, m.index + len(m.token_ids))] == [3, 4, 5, 6, 7]
    assert {m.migration for m in events} == {1}
    await svc._on_cancel(Cancel("r1", "client disconnected"), ENV)
    await svc._on_job(dataclasses.replace(short, request=dataclasses.replace(short.request, migration=2)), ENV)
    assert svc.jobs["dropped"] == 2 and svc.jobs["run"] == 2
    free, total = await free_blocks(svc)
    assert free == total and not svc.active
    await svc.engine.stop()
