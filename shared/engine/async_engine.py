"""The engine driven from asyncio: one thread owns the engine, the event loop never blocks on a step.

Every engine call (add, step, export, abort, release) runs on a single worker thread, so they are serialised
without locks; between two steps the loop's queued calls run, which is how requests join and leave the running
batch at every step (continuous batching). Each request's outputs arrive on its own asyncio queue.

Nothing else may touch the engine: its scheduler's deques change under any other thread's feet (reading
`Engine.stats()` from the event loop raised "deque mutated during iteration" mid-step). What the loop needs to
know (heartbeats, health) it reads from `stats`, a frozen snapshot the engine thread takes after its calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from shared.engine.api import EngineFailure, EngineStats, KvLayout
from shared.engine.engine import Engine, EngineRequest, StepOutput

log = logging.getLogger(__name__)

T = TypeVar("T")

STATS_EVERY_S = 0.05  # a snapshot after a step at most this often (heartbeats are 1 s apart); always after others


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._outputs: dict[str, asyncio.Queue[StepOutput | EngineFailure | None]] = {}
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopped = False
        self._stats = engine.stats()  # no engine thread yet: safe to read here
        self._stats_at = time.monotonic()
        self.layout = KvLayout(engine.block_tokens, engine.block_bytes, engine.cache_id, engine.has_request_state,
                               engine.replay_tokens, str(engine.device))

    @property
    def stats(self) -> EngineStats:
        """The engine's counters as of its last call or step (at most STATS_EVERY_S old while it steps)."""
        return self._stats

    @property
    def block_tokens(self) -> int:
        return self.engine.block_tokens

    @property
    def cache_id(self) -> str:
        return self.engine.cache_id

    # --- the KV a worker moves: each an engine call between steps ---------------------------------------------

    async def cached_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of `hashes` the engine's own prefix cache holds now."""
        return await self.call(self.engine.cached_blocks, hashes)

    async def release(self, request_id: str) -> None:
        """Free a held request's blocks (its KV is exported or no longer wanted)."""
        await self.call(self.engine.release, request_id)

    async def export_blocks(self, request_id: str, start: int, end: int) -> list[bytes]:
        return await self.call(self.engine.export_blocks, request_id, start, end)

    async def export_state(self, request_id: str) -> bytes:
        """The request's per-request state (b"" for a model without one)."""
        if not self.layout.has_request_state:
            return b""
        return await self.call(self.engine.export_state, request_id)

    async def export_into(self, request_id: str, base: int, parts: list[tuple[int, int, memoryview]]) -> None:
        """Blocks base + [lo, hi) of a request into each part's buffer, in one engine call."""
        await self.call(self.engine.export_parts, request_id, base, parts)

    async def export_device(self, request_id: str, blocks: int, state: bytes, nbytes: int) -> torch.Tensor:
        """Blocks [0, blocks) of a request, then `state`, back to back in a new uint8 buffer of `nbytes` (the rest
        zero) on the engine's GPU: one gather on the device, no host copy (a hand-over by CUDA IPC). Raises
        torch.OutOfMemoryError when the GPU has no room for it."""
        return await self.call(_export_device, self.engine, request_id, blocks, state, nbytes)

    async def expert_counts(self) -> torch.Tensor | None:
        """The model's cumulative (layers, experts) routing counts (Engine.expert_counts), between two steps."""
        return await self.call(self.engine.expert_counts)

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run())

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the engine thread, between steps."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._then_snapshot, fn, args)

    def _then_snapshot(self, fn: Callable[..., T], args: tuple[object, ...]) -> T:
        """On the engine thread: the call, then a new stats snapshot (rate-limited for steps: they are many)."""
        try:
            return fn(*args)
        finally:
            now = time.monotonic()
            if fn != self.engine.step or now - self._stats_at >= STATS_EVERY_S:
                self._stats, self._stats_at = self.engine.stats(), now  # one reference swap: readers see whole ones

    async def generate(self, req: EngineRequest) -> AsyncIterator[StepOutput]:
        """Add the request and yield its outputs until it finishes or is aborted.

        Leaving the iteration early (the consumer stopped or was cancelled) aborts the request, so its blocks
        are freed whatever happens to the caller.
        """
        queue: asyncio.Queue[StepOutput | EngineFailure | None] = asyncio.Queue()
        self._outputs[req.request_id] = queue
        finished = aborted = False
        try:
            await self.call(self.engine.add, req)
            self._wakeup.set()
            while True:
                out = await queue.get()
                if out is None:  # aborted (by abort/abort_many or stop: the engine let it go)
                    aborted = True
                    return
                if isinstance(out, EngineFailure):  # its step failed: the engine dropped it already
                    aborted = True
                    raise out
                yield out
                if out.finish_reason is not None:
                    finished = True
                    return
        finally:
            self._outputs.pop(req.request_id, None)
            if not finished and not aborted and not self._stopped:
                await self.call(self.engine.abort, req.request_id)

    async def abort(self, request_id: str) -> None:
        await self.abort_many([request_id])

    async def abort_many(self, request_ids: list[str]) -> None:
        """Abort all of them in one engine call: a burst of cancels costs one step boundary, not one each."""
        if not request_ids:
            return
        queues = [q for q in (self._outputs.pop(r, None) for r in request_ids) if q is not None]
        await self.call(self._abort_all, request_ids)
        for queue in queues:
            queue.put_nowait(None)

    def _abort_all(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.abort(request_id)

    async def _run(self) -> None:
        while not self._stopped:
            if not self.engine.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                outputs = await self.call(self.engine.step)
            except Exception as exc:
                log.exception("engine step failed; aborting its requests")
                failure = EngineFailure(f"engine step failed: {type(exc).__name__}: {exc}")
                for request_id, queue in list(self._outputs.items()):
                    await self.call(self.engine.abort, request_id)
                    queue.put_nowait(failure)
                continue
            for out in outputs:
                queue = self._outputs.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            await asyncio.sleep(0)  # let queued adds/aborts reach the engine thread before the next step

    async def stop(self) -> None:
        self._stopped = True
        self._wakeup.set()
        if self._loop_task is not None:
            await self._loop_task
        for queue in self._outputs.values():
            queue.put_nowait(None)
        self._thread.shutdown(wait=True)
        self.engine.close()  # an expert-parallel engine's other ranks


def _export_device(engine: Engine, request_id: str, blocks: int, state: bytes, nbytes: int) -> torch.Tensor:
    assert engine.device.type == "cuda", "a device export needs the engine on a GPU"
    buf = torch.empty(nbytes, dtype=torch.uint8, device=engine.device)
    at = blocks * engine.block_bytes
    engine.export_into(request_id, 0, blocks, buf[:at])
    if state:
        buf[at : at + len(state)].copy_(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    buf[at + len(state) :].zero_()
    return buf


