"""What prefill and decode workers share: load the engine, take jobs from a JetStream work queue, heartbeat to
the balancers, free a request's KV on cancel, report health.

A worker's job handler is its role; everything else is here. The work message is acked when the job is done
(kept alive meanwhile), so a worker that dies mid-job has its job redelivered rather than lost.

A request that ended here (done, or cancelled on `requests.cancel`) is remembered for a while: its job, should it
come again (redelivered, or overtaken by its cancel), is settled at once and not run. What is remembered is the
request's migration (GenerateRequest.migration) that ended: a worker that lost a request (silent, or killed and
restarted) drops the redelivered jobs of that migration, yet runs a later continuation of the same request.

Cancels are marked as they arrive and aborted in batches, one engine call per step boundary for all of them, so
a flood of hang-ups never waits a step each; a cancel that lands while the KV is being exported ends that work
quietly (no redelivery).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from abc import ABC, abstractmethod
from collections import Counter
from typing import Any

import orjson

from shared import subjects
from shared.bus import Bus, BusError, BusTimeout, Envelope, Retry, WorkQueue
from shared.config import ServiceConfig, default_batch_tokens
from shared.engine.api import EngineFailure, RequestError
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import Engine, EngineRequest  # EngineRequest: what the role handlers submit
from shared.kv_events import EventPublisher
from shared.worker.config import WorkerConfig
from shared.worker.expert_counts import ExpertCounts
from shared.kv_arena import Arena
from shared.worker.kv_cuda_ipc import pin_heap, pin_host
from shared.worker.kv_transfer import KvTransfer
from shared.worker.kvclient import MiB, KvClient, open_client
from shared.models import resolve
from shared.schemas.balancer import LostQuery, LostReply
from shared.schemas.events import TIER_LOCAL
from shared.schemas.generate import EVERY_WORKER, Cancel, TokenEvent
from shared.schemas.workers import Heartbeat, RequestDone

__all__ = ["EngineRequest", "EngineWorker"]

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
ENDED_MEMORY_S = 300.0  # a cancel may overtake its job, a redelivery may follow its end: remember them this long
EVERY = sys.maxsize  # the migration a plain Cancel ends: all of them, later continuations included
LOST_QUERY_TIMEOUT_S = 2.0  # a starting worker waits this long for the balancer's word of what moved on
EARLIER_RUNNING_RETRY_S = 0.5  # a continuation waits this long while its lost predecessor is aborted here


class EngineWorker(ABC):
    role: str
    job_type: type[Any]

    def __init__(self, config: ServiceConfig, worker: WorkerConfig) -> None:
        self.name = self.role
        self.config = config
        self.worker = worker
        self.model_name = config.model_name(resolve(config.model).name)  # what the recipe routes requests by
        self.bus: Bus | None = None
        self.kv: KvClient | None = None
        self._kv_bus: Bus | None = None  # the KV store's own connection (see start)
        self.engine: AsyncEngine | None = None
        self.transfer: KvTransfer | None = None  # the engine's KV to and from the store, once it is loaded
        self.active: dict[str, int] = {}  # request id -> the migration of it running here
        # request id -> (when, the latest migration of it that was cancelled or finished here; see _forget)
        self._ended: dict[str, tuple[float, int]] = {}
        self._cancelled: dict[str, int] = {}  # of those, the ones a Cancel ended -> up to which migration
        self._to_abort: set[str] = set()  # cancelled while active, not yet aborted in the engine
        self._aborter: asyncio.Task[None] | None = None
        self.jobs: Counter[str] = Counter()  # jobs run / dropped (already ended) / cancelled, for health
        self._status = "loading model"
        self._tasks: list[asyncio.Task[None]] = []
        self._queue: WorkQueue | None = None
        self.kv_events: EventPublisher | None = None  # the local prefix cache's changes, for the balancers
        self.expert_counts: ExpertCounts | None = None  # the routing counts, for the balancer's experts role

    # --- Service protocol ---------------------------------------------------------------------------------------

    async def start(self, bus: Bus) -> None:
        self.bus = bus
        # KV blocks ride their own connection: a burst of megabytes to the store never delays a heartbeat (the
        # balancer drops a worker silent for 3 s), a token or a work message's ack on `bus`.
        self._kv_bus = await bus.sibling("kv")
        self.kv = open_client(self._kv_bus, self.worker.kv_transport, self.config.instance,
                              arena_bytes=self.worker.kv_arena_mib * MiB)
        self._tasks.append(asyncio.create_task(self._load_then_serve()))

    def health(self) -> tuple[bool, str]:
        """Not ready: what it is doing (loading the model). Ready: a JSON report, with what this worker saw of
        the KV store (blocks put and got, puts that failed, gets and lookups that failed)."""
        ready = self.engine is not None and self._queue is not None
        if not ready or self.engine is None:
            return False, self._status
        stats = self.engine.stats
        detail: dict[str, Any] = {
            "status": self._status,
            "kv": dict(self.kv.counts) if self.kv else {},
            "jobs": dict(self.jobs),
            "active": len(self.active),
            "free_blocks": stats.free_blocks,
            "total_blocks": stats.total_blocks,
        }
        detail["held"] = stats.held
        detail["handover"] = self.handover_counts()
        if self.expert_counts is not None:
            detail["experts"] = self.expert_counts.health()
        if self.worker.speculative_tokens:
            detail["speculative"] = {"method": self.worker.speculative_method, "drafted": stats.drafted,
                                     "accepted": stats.accepted, "verifies": stats.verifies}
        return True, orjson.dumps(detail).decode()

    async def stop(self) -> None:
        if self._queue is not None:
            await self._queue.stop()
        for task in self._tasks:
            task.cancel()
        if self.expert_counts is not None:  # before the engine: it reads the engine's counts
            await self.expert_counts.stop()
        if self.engine is not None:
            await self.engine.abort_many(list(self.active))
            await self.engine.stop()
        if self.kv_events is not None:
            await self.kv_events.close()
        if self._kv_bus is not None:
            await self._kv_bus.drain()
        if self.kv is not None and self.kv.arena is not None:
            self.kv.arena.close()

    # --- internals ----------------------------------------------------------------------------------------------

    async def _load_then_serve(self) -> None:
        assert self.bus is not None
        started = time.monotonic()
        try:
            engine = await asyncio.to_thread(
                Engine,
                self.config.model,
                device=self.worker.device,
                kv_blocks=self.worker.kv_blocks,
                max_batch_tokens=self.worker.max_batch_tokens or default_batch_tokens(self.role, self.worker.device),
                max_running=self.worker.max_running,
                # prefill drafts nothing itself, but feeds the MTP layer the prompt so decode's drafts start warm
                speculative_tokens=self.worker.speculative_tokens,
                speculative_method=self.worker.speculative_method,
                speculative_policy=self.worker.speculative_policy,
                max_model_len=self.config.max_model_len,
                gpu_memory_utilization=self.worker.gpu_memory_utilization,
                quantization=self.worker.quantization,
                kv_cache_dtype=self.worker.kv_cache_dtype,
                load_format=self.worker.load_format,
                cuda_graphs=not self.worker.enforce_eager,
                deterministic=self.worker.deterministic,
                expert_parallel=self.worker.expert_parallel,
            )
        except Exception as exc:
            log.exception("could not load model %s", self.config.model)
            self._status = f"failed to load model: {exc}"
            os.kill(os.getpid(), signal.SIGTERM)  # a worker without a model has nothing to offer: exit
            return
        if self.role == "decode":  # prefill never decodes: its engine keeps none
            captured = time.monotonic()
            graphs = await asyncio.to_thread(engine.warm_up)
            if graphs:
                log.info("captured %d decode CUDA graphs in %.1fs", graphs, time.monotonic() - captured)
        elif engine.device.type == "cuda":  # first uses compile there (Engine.warm_up_prefill)
            warmed = time.monotonic()
            tokens = await asyncio.to_thread(engine.warm_up_prefill)
            log.info("warmed up prefill on %d prompt tokens in %.1fs", tokens, time.monotonic() - warmed)
        self.use_engine(AsyncEngine(engine))
        assert self.engine is not None
        await self._publish_kv_events(engine, self.engine)
        self.engine.start()
        log.info("loaded %s in %.1fs on %s (%s%s%s)", self.model_name, time.monotonic() - started, engine.device,
                 str(engine.dtype).removeprefix("torch."), ", deterministic" if engine.deterministic else "",
                 ", dummy weights" if self.worker.load_format == "dummy" else "")
        log.info("%s", engine.memory().line())
        await self.bus.subscribe(subjects.CANCEL, Cancel, self._on_cancel)
        await self.serve_handover()
        if self.worker.expert_counts_interval_s > 0 and engine.expert_bytes:  # routed experts to count
            self.expert_counts = ExpertCounts(self.engine, self.config.instance, self.role, self.model_name,
                                              self.worker.expert_counts_interval_s)
            await self.expert_counts.start(self.bus)
        if engine.device.type == "cuda":
            self._pin_arenas()
        await self._hear_lost()
        self._tasks.append(asyncio.create_task(self._heartbeat()))
        self._queue = await self.bus.work_queue(
            self.work_subject(),
            f"{self.role}-{self.config.instance}",
            self.job_type,
            self._on_job,
            concurrency=self.worker.max_running,
            ack_wait=30.0,
        )
        self._status = "ready"

    async def _hear_lost(self) -> None:
        """Before the first job: the Cancels the balancer sent while this worker was lost (a restart). JetStream
        redelivers the jobs the dead process held once their ack wait is over, and at a slow start that is at
        once: heard only with the first heartbeat, those Cancels would race the jobs they end."""
        assert self.bus is not None
        try:
            reply = await self.bus.request(subjects.BALANCER_LOST, LostQuery(self.config.instance), LostReply,
                                           timeout=LOST_QUERY_TIMEOUT_S)
        except BusError as exc:  # its rejoin's Cancels still come (the balancer sends them again then)
            log.warning("could not ask the balancer what moved on while this worker was lost: %s", exc)
            return
        except BusTimeout:  # no balancer yet: nothing was routed anywhere, so nothing moved on
            return
        for cancel in reply.cancels:
            self._take_cancel(cancel)
        if reply.cancels:
            log.info("%d requests moved on while this worker was lost: their jobs are dropped", len(reply.cancels))

    def _pin_arenas(self) -> None:
        """On a GPU, page-lock the shared-memory arenas whose bytes cross to or from the device (the store's runs
        imported, a hand-over exported), so each crossing is one DMA at the bus's rate; and each map of the store's
        shared heap as the worker makes it (store hits are imported from there)."""
        for arena in self.arenas():
            pin_host(arena)
        if self.kv is not None:
            self.kv.on_heap = pin_heap

    def arenas(self) -> list[Arena]:
        """This worker's shared-memory arenas (the store's; a role may add its own)."""
        return [self.kv.arena] if self.kv is not None and self.kv.arena is not None else []

    def use_engine(self, engine: AsyncEngine) -> None:
        """The loaded engine, and the KV transfer over it and the KV client (`start` opened that)."""
        assert self.bus is not None and self.kv is not None
        self.engine = engine
        self.transfer = KvTransfer(engine, self.kv, self.bus.max_payload, self.cancelled)

    async def _publish_kv_events(self, engine: Engine, runner: AsyncEngine) -> None:
        """Tell the balancers what the local prefix cache holds: its changes as they happen (the listener runs on
        the engine thread; the publisher buffers and sends from the event loop), and snapshots taken on the
        engine thread, between steps, so no change slips between the hashes and their seq."""
        assert self.bus is not None
        events = self.kv_events = EventPublisher(self.bus, self.config.instance)
        engine.blocks.listener = lambda op, hashes: events.record(op, TIER_LOCAL, hashes)
        await events.serve_snapshots(lambda: {TIER_LOCAL: engine.blocks.cached_hashes()}, run=runner.call)

    def work_subject(self) -> str:
        if self.role == "prefill":
            return subjects.prefill_work(self.config.instance)
        return subjects.decode_work(self.config.instance)

    async def _on_job(self, job: Any, env: Envelope) -> None:
        request = job.request
        request_id, migration = request.request_id, request.migration
        running = self.active.get(request_id)
        if self._ended.get(request_id, (0.0, -1))[1] >= migration or (running is not None and running >= migration):
            # settled (acked), not run: the client has had its answer or its cancel, the request moved on past this
            # migration, or the job is running already
            self.jobs["dropped"] += 1
            log.info("dropping a job for %s (migration %d): %s", request_id, migration,
                     "running already" if running is not None else "that part of the request already ended")
            return
        if running is not None:
            # a continuation of a request whose earlier migration this worker still runs (it was taken for lost
            # while only silent): the Cancel for that one is on its way; the engine holds one of each id
            raise Retry(f"{request_id}: migration {running} still running here", EARLIER_RUNNING_RETRY_S)
        self.active[request_id] = migration
        self.jobs["run"] += 1
        failed = False
        try:
            await self.handle(job, env)
        except RequestError as exc:
            # the engine refused what the client asked: answer it (a 400 in the API's format) and settle the
            # job, rather than fail it into redelivery that would refuse it again
            log.info("%s: refused by the engine: %s", request_id, exc)
            await self.publish_tokens(TokenEvent(request_id, index=request.output_offset, token_ids=[],
                                                 finish_reason="error", error=str(exc), error_status=400,
                                                 migration=migration), env)
        except EngineFailure as exc:
            # the engine failed under the request (not the client's doing): fail it explicitly now, and settle
            # the job, since a redelivery would most likely fail the same way on the same worker
            log.error("%s: %s", request_id, exc)
            await self.publish_tokens(TokenEvent(request_id, index=request.output_offset, token_ids=[],
                                                 finish_reason="error", error=str(exc), error_status=500,
                                                 migration=migration), env)
        except Exception:
            if not self.cancelled(request_id):
                failed = True  # redelivered to try again: not an end to remember
                raise
            # the cancel freed the request under a step of it (an export, a store): the work is over, not failed
            log.info("%s: cancelled mid-job", request_id)
        finally:
            was_cancelled = self.cancelled(request_id)
            del self.active[request_id]
            if not failed:
                self._end(request_id, migration)
            if was_cancelled:
                self.jobs["cancelled"] += 1
            assert self.bus is not None
            await self.bus.publish(subjects.WORKER_DONE,
                                   RequestDone(request_id, self.config.instance, self.role, migration=migration))

    @abstractmethod
    async def handle(self, job: Any, env: Envelope) -> None: ...

    # --- the hand-over between prefill and decode (shared/worker/kv_peer.py): each role fills in its side -------------

    async def serve_handover(self) -> None:
        """Once the engine is loaded, before the first job: subscribe to what the role's hand-over needs."""

    def handover_counts(self) -> dict[str, int]:
        """The hand-over's counters, for health."""
        return {}

    def on_cancel(self, request_id: str) -> None:
        """A Cancel for a request this worker may hold outside the engine (a hand-over): let it go now."""

    def on_peer_lost(self, cancel: Cancel) -> None:
        """A Cancel addressed to another worker (`cancel.worker_id`, of `cancel.role`), which the balancer took for
        lost: what this worker holds only for that one (a hand-over it was to pull) can go now, not at its lease."""

    def cancelled(self, request_id: str) -> bool:
        """Whether a Cancel ended the request's migration running here: its handler stops at the next stage
        rather than start it."""
        return self._cancelled.get(request_id, -1) >= self.active.get(request_id, 0)

    def _end(self, request_id: str, migration: int) -> None:
        now = time.monotonic()
        _, before = self._ended.pop(request_id, (now, -1))  # re-inserted last: the dict stays in time order
        self._ended[request_id] = (now, max(before, migration))
        self._forget(now)  # stops at the first fresh entry: constant work per call, amortised

    def _forget(self, now: float) -> None:
        for request_id, (at, _) in list(self._ended.items()):
            if now - at <= ENDED_MEMORY_S:
                break  # insertion order is time order
            del self._ended[request_id]
            self._cancelled.pop(request_id, None)

    async def _on_cancel(self, cancel: Cancel, _: Envelope) -> None:
        self._take_cancel(cancel)

    def _take_cancel(self, cancel: Cancel) -> None:
        """Mark, and leave the engine to the aborter: a Cancel never waits for a step (the subscription runs its
        messages one at a time, so waiting here would queue every later cancel behind it).

        A plain Cancel ends every migration of the request; one addressed to this worker (it was taken for lost)
        or to every worker (the request's recipe was lost) ends the migrations up to the one it names, and a later
        continuation may still run here."""
        request_id = cancel.request_id
        if cancel.worker_id not in ("", self.config.instance, EVERY_WORKER):
            self.on_peer_lost(cancel)
            return
        upto = cancel.migration if cancel.worker_id else EVERY
        if self._cancelled.get(request_id, -1) >= upto:
            return
        self._cancelled[request_id] = upto
        self._end(request_id, upto)
        running = self.active.get(request_id)
        if running is None or running <= upto:
            self.on_cancel(request_id)
        if running is not None and running <= upto:
            log.info("cancel %s (%s)", request_id, cancel.reason)
            self._to_abort.add(request_id)
            if self._aborter is None or self._aborter.done():
                self._aborter = asyncio.create_task(self._abort_pending())

    async def _abort_pending(self) -> None:
        """Abort every request cancelled since the last engine call, all in one call between two steps."""
        while self._to_abort and self.engine is not None:
            batch, self._to_abort = list(self._to_abort), set()
            try:
                await self.engine.abort_many(batch)
            except Exception:  # the request may be gone already; never let one failure strand the rest
                log.exception("aborting %d cancelled requests failed", len(batch))

    async def publish_tokens(self, event: TokenEvent, env: Envelope) -> None:
        assert self.bus is not None
        await self.bus.publish(subjects.tokens(event.request_id), event, trace=env.trace)

    async def _heartbeat(self) -> None:
        while True:
            try:
                await self._beat()
            except Exception:  # never let one bad beat end the loop: a silent worker is dropped from the pool
                log.exception("heartbeat failed")
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _beat(self) -> None:
        assert self.bus is not None and self.engine is not None
        stats = self.engine.stats  # the engine thread's snapshot: never read the engine from the loop
        beat = Heartbeat(
            worker_id=self.config.instance,
            role=self.role,
            model=self.model_name,
            queued_tokens=stats.queued_tokens,
            running=stats.running + stats.waiting,
            free_blocks=stats.free_blocks,
            total_blocks=stats.total_blocks,
            cache_id=self.engine.cache_id,
            block_tokens=self.engine.block_tokens,
            sent_at=time.time(),
            waiting=stats.waiting,
            spec_drafted=stats.drafted,
            spec_verifies=stats.verifies,
            spec_accepted=stats.accepted,
        )
        try:
            await self.bus.publish(subjects.HEARTBEAT, beat)
        except Exception as exc:  # reconnecting: the balancer will notice the gap
            log.debug("heartbeat not sent: %s", exc)

