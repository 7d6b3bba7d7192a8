"""The balancer: routes each role's jobs from its route queue to one worker's work queue.

    workers --workers.heartbeat--> registry            (who is alive, how loaded)
    route queue --job--> policy(snapshot, demand) --> submit to work.<role>.<worker>, remember the assignment
    no worker: Retry (nak with delay) until `route_wait_s` has passed, then a 503 error TokenEvent
    worker silent for `worker_timeout_s`: it leaves the pool; its prefill jobs go to another worker, its decode
        jobs fail with a 503 TokenEvent (the generated tokens were only on that worker)
    workers.done / requests.cancel / the next role taking over / a TTL: the assignment is forgotten

Placement and its bookkeeping happen without an `await` in between, so concurrent handlers each see the work
the others just placed (see registry.py on pending assignments).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from nats.aio.subscription import Subscription

from services.balancer.assignments import Assignment, Assignments
from services.balancer.policies import POLICIES, Policy
from services.balancer.registry import WorkerRegistry
from services.balancer.roles import ROLES, Role
from shared import subjects, tracing
from shared.bus import Bus, Envelope, Retry, WorkQueue
from shared.schemas.generate import Cancel, TokenEvent
from shared.schemas.workers import Heartbeat, RequestDone

log = logging.getLogger(__name__)


class BalancerService:
    name = "balancer"

    def __init__(
        self,
        roles: Sequence[str] = ("prefill", "decode"),
        *,
        worker_timeout_s: float = 3.0,
        route_wait_s: float = 30.0,
        retry_delay_s: float = 0.5,
        concurrency: int = 16,
        max_reroutes: int = 2,
        assignment_ttl_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        unknown = [r for r in roles if r not in ROLES]
        if unknown or not roles:
            raise ValueError(f"roles must be some of {sorted(ROLES)}, got {list(roles)}")
        if worker_timeout_s <= 0 or route_wait_s < 0 or retry_delay_s <= 0 or concurrency < 1:
            raise ValueError("timeouts, delays and concurrency must be positive")
        self._roles: dict[str, Role[Any]] = {name: ROLES[name]() for name in roles}
        self._policies: dict[str, Policy] = {n: POLICIES[r.policy]() for n, r in self._roles.items()}
        self.registry = WorkerRegistry(worker_timeout_s)
        self.assignments = Assignments()
        self._route_wait_s = route_wait_s
        self._retry_delay_s = retry_delay_s
        self._concurrency = concurrency
        self._max_reroutes = max_reroutes
        self._ttl_override = assignment_ttl_s
        self._clock = clock
        self._waiting: dict[tuple[str, str], float] = {}  # (request id, role) -> when it started waiting
        self.stats: Counter[str] = Counter()
        self._bus: Bus | None = None
        self._queues: list[WorkQueue] = []
        self._subs: list[Subscription] = []
        self._reaper: asyncio.Task[None] | None = None

    # --- Service protocol --------------------------------------------------------------------------------------

    async def start(self, bus: Bus) -> None:
        self._bus = bus
        self._subs = [
            await bus.subscribe(subjects.HEARTBEAT, Heartbeat, self._on_heartbeat),
            await bus.subscribe(subjects.WORKER_DONE, RequestDone, self._on_done),
            await bus.subscribe(subjects.CANCEL, Cancel, self._on_cancel),
        ]
        # Every Retry is a delivery: allow enough of them to wait out `route_wait_s`, plus a few real failures.
        max_deliver = math.ceil(self._route_wait_s / self._retry_delay_s) + 10
        for role in self._roles.values():
            self._queues.append(
                await bus.work_queue(
                    role.route_subject,
                    role.durable,
                    role.job_type,
                    functools.partial(self._on_job, role.name),
                    concurrency=self._concurrency,
                    max_deliver=max_deliver,
                )
            )
        self._reaper = asyncio.create_task(self._reap_forever())

    async def stop(self) -> None:
        for queue in self._queues:
            await queue.stop()
        self._queues = []
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs = []
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)

    def health(self) -> tuple[bool, str]:
        detail = {
            "roles": list(self._roles),
            "workers": self.registry.counts(),
            "assignments": len(self.assignments),
            **self.stats,
        }
        return self._bus is not None, orjson.dumps(detail).decode()

    # --- routing -----------------------------------------------------------------------------------------------

    async def _on_job(self, role: str, job: Any, _: Envelope) -> None:
        await self.route(role, job)

    async def route(self, role_name: str, job: Any) -> None:
        """Place one job of `role_name`; raises Retry while no worker can take it and the wait is not over."""
        role = self._roles[role_name]
        request = role.request(job)
        rid = request.request_id
        now = self._clock()
        if self.assignments.is_cancelled(rid):
            log.info("dropping %s job for cancelled request %s", role.name, rid)
            return
        if role.follows is not None:
            self.assignments.drop(rid, role.follows)  # the previous role's worker has handed the request on
        if self.assignments.get(rid, role.name) is not None:
            return  # a redelivery of a job already placed (its ack was lost)
        key = (rid, role.name)
        if await self._place(role, job, now) is not None:
            self._waiting.pop(key, None)
            return
        started = self._waiting.setdefault(key, self._wait_start(role, request.arrival, now))
        if now - started < self._route_wait_s:
            raise Retry(f"no {role.name} worker for {request.model}", self._retry_delay_s)
        del self._waiting[key]
        log.warning("no %s worker for %s (model %s) after %.0fs", role.name, rid, request.model, now - started)
        self.stats["failed_no_worker"] += 1
        await self._fail(rid, f"no {role.name} worker available")

    async def _place(self, role: Role[Any], job: Any, now: float, attempt: int = 0) -> str | None:
        """Choose a worker and hand it the job; None when no worker can take it now."""
        assert self._bus is not None
        request = role.request(job)
        demand = role.demand(job)
        choice = self._policies[role.name].choose(self.registry.candidates(role.name, request.model, now), demand)
        if choice is None:
            return None
        worker = choice.worker_id
        pending = self.registry.assign(worker, demand.prompt_tokens, demand.blocks_needed, now)
        ttl = self._ttl_override if self._ttl_override is not None else role.assignment_ttl_s
        assignment = Assignment(
            request_id=request.request_id,
            role=role.name,
            worker_id=worker,
            job=job if role.reroutable else None,
            at=now,
            expires_at=now + ttl,
            attempt=attempt,
            trace=tracing.current(),
        )
        self.assignments.add(assignment)
        subject, message = role.address(job, worker)
        msg_id = f"{request.request_id}:{role.name}" + (f":{attempt}" if attempt else "")
        try:
            await self._bus.submit(subject, message, msg_id=msg_id)
        except Exception:
            if pending is not None:
                self.registry.unassign(worker, pending)
            self.assignments.drop(request.request_id, role.name, worker)
            raise
        self.stats[f"routed_{role.name}"] += 1
        return worker

    def _wait_start(self, role: Role[Any], arrival: float, now: float) -> float:
        # The first hop counts from the gateway's arrival stamp (time already spent queued counts); later hops
        # from when this balancer first saw the job, since prefill itself may have taken long. min() bounds the
        # wait even when the gateway's clock runs ahead of ours.
        if role.follows is None and arrival > 0:
            return min(arrival, now)
        return now

    async def _fail(self, request_id: str, error: str) -> None:
        """End a request with an explicit error, so the client gets a 503 rather than a hang."""
        assert self._bus is not None
        # Index 0: the balancer does not know how far the request got. Consumers end a stream on any error event.
        event = TokenEvent(request_id, index=0, token_ids=[], finish_reason="error", error=error, error_status=503)
        await self._bus.publish(subjects.tokens(request_id), event)

    # --- pool changes ------------------------------------------------------------------------------------------

    async def _reap_forever(self) -> None:
        interval = min(1.0, self.registry.timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reap(self._clock())
            except Exception:
                log.exception("balancer reap failed")

    async def reap(self, now: float) -> None:
        """Expire silent workers and recover what they held; forget stale bookkeeping."""
        for worker_id in self.registry.expire(now):
            lost = self.assignments.take_worker(worker_id)
            log.warning(
                "worker %s left the pool (silent > %.1fs), holding %d requests",
                worker_id,
                self.registry.timeout_s,
                len(lost),
            )
            self.stats["workers_lost"] += 1
            for assignment in lost:
                await self._recover(assignment, now)
        self.assignments.expire(now)
        self._waiting = {k: t for k, t in self._waiting.items() if now - t < 2 * self._route_wait_s + 60}

    async def _recover(self, lost: Assignment, now: float) -> None:
        role = self._roles.get(lost.role)
        if role is None:
            return
        with tracing.tracer().start_as_current_span(f"balancer recover {lost.role}", context=lost.trace):
            if role.reroutable and lost.job is not None and lost.attempt < self._max_reroutes:
                try:
                    worker = await self._place(role, lost.job, now, attempt=lost.attempt + 1)
                except Exception:
                    log.exception("re-routing %s failed", lost.request_id)
                    worker = None
                if worker is not None:
                    log.info("re-routed %s %s from %s to %s", lost.role, lost.request_id, lost.worker_id, worker)
                    self.stats["rerouted"] += 1
                    return
            self.stats["failed_worker_lost"] += 1
            await self._fail(lost.request_id, "worker lost")

    # --- broadcasts --------------------------------------------------------------------------------------------

    async def _on_heartbeat(self, beat: Heartbeat, _: Envelope) -> None:
        if self.registry.observe(beat, self._clock()):
            log.info("worker %s (%s, %s) joined the pool", beat.worker_id, beat.role, beat.model)

    async def _on_done(self, done: RequestDone, _: Envelope) -> None:
        self.assignments.drop(done.request_id, done.role, done.worker_id)

    async def _on_cancel(self, cancel: Cancel, _: Envelope) -> None:
        self.assignments.cancel(cancel.request_id, list(self._roles), self._clock())
        for role in self._roles:
            self._waiting.pop((cancel.request_id, role), None)
