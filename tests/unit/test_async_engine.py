"""The engine driven from asyncio: the loop reads the engine's counters only as the engine thread's snapshot.

Reading `Engine.stats()` from the loop while the engine thread stepped raised "deque mutated during iteration"
(6 of 919 heartbeats with 2,000 waiting sequences), and one such error ended the heartbeat task.
"""

from __future__ import annotations

import asyncio

import torch

from shared.engine.api import EngineFailure, EngineRequest
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import Engine
from shared.engine.loader import LoadedModel
from shared.schemas.generate import SamplingParams
from tests.unit.test_engine_tiny import checkpoint, loaded  # noqa: F401  (fixtures)


def _request(i: int) -> EngineRequest:
    return EngineRequest(f"r{i}", [1 + i % 50, 2, 3, 4], SamplingParams(temperature=0.0), max_new_tokens=3)


async def test_stats_are_a_snapshot_read_while_the_engine_steps(loaded: LoadedModel) -> None:  # noqa: F811
    engine = AsyncEngine(Engine(loaded, device="cpu", dtype=torch.float32, kv_blocks=64, max_running=4))
    engine.start()
    idle = engine.stats
    assert idle.running == idle.waiting == 0 and idle.free_blocks == idle.total_blocks

    async def consume(i: int) -> int:
        return sum(len(out.token_ids) for out in [o async for o in engine.generate(_request(i))])

    jobs = [asyncio.create_task(consume(i)) for i in range(64)]  # far more than max_running: most wait
    seen_waiting = 0

    async def watch() -> None:
        nonlocal seen_waiting
        while not all(job.done() for job in jobs):
            snapshot = engine.stats  # from the loop, mid-step: a whole frozen snapshot, never the live deques
            seen_waiting = max(seen_waiting, snapshot.waiting)
            assert snapshot.running <= 4 and 0 <= snapshot.free_blocks <= snapshot.total_blocks
            await asyncio.sleep(0.002)  # (a sleep(0) spin would starve the engine thread of the GIL)

    await asyncio.wait_for(asyncio.gather(watch(), *jobs), timeout=120)  # fails, never hangs
    assert [job.result() for job in jobs] == [3] * 64
    assert seen_waiting > 0  # the snapshots followed the queue while it was long
    await engine.call(lambda: None)  # any call ends with a fresh snapshot
    assert engine.stats.running == engine.stats.waiting == 0
    await engine.stop()


async def test_a_failed_step_fails_its_requests_explicitly_and_the_engine_goes_on(loaded: LoadedModel) -> None:  # noqa: F811
    """A step that raises (a kernel error, out of device memory) ends every request in it with EngineFailure,
    which the worker answers as a 500 at once, instead of a silent end the client would wait on; the blocks are
    freed and the next request runs as if nothing happened."""
    engine = AsyncEngine(Engine(loaded, device="cpu", dtype=torch.float32, kv_blocks=64, max_running=4))
    engine.start()
    real_step = engine.engine.step
    calls = 0

    def failing_step() -> list:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_step()

    engine.engine.step = failing_step  # type: ignore[method-assign]

    async def consume(i: int) -> int:
        return sum(len(out.token_ids) for out in [o async for o in engine.generate(_request(i))])

    results = await asyncio.wait_for(asyncio.gather(consume(0), consume(1), return_exceptions=True), timeout=60)
    assert all(isinstance(r, EngineFailure) and "illegal memory access" in str(r) for r in results), results
    assert await asyncio.wait_for(consume(2), timeout=60) == 3  # the engine still serves
    await engine.call(lambda: None)
    assert engine.stats.free_blocks == engine.stats.total_blocks  # the failed requests hold nothing
    await engine.stop()
