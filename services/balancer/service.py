"""The balancer: routes each role's jobs from its route queue to one worker's work queue.

    workers --workers.heartbeat--> registry            (who is alive, how loaded, how it names KV blocks)
    caches --kv.events.>--> prefix index               (who holds which blocks; a gap -> kv.snapshot.<source>)
    route queue --job--> role.demand(job, candidates)   (prefill: each worker's cached prefix; decode: affinity)
        --> policy(candidates, demand) --> submit to work.<role>.<worker>, remember the assignment
    the experts role (--roles ...,experts): workers --experts.load--> sliding windows --> a placement per worker
        group on a period or past an imbalance --experts.plan--> workers (experts/; it routes no jobs)
    no worker: Retry (nak with delay) until `route_wait_s` has passed, then a 503 error TokenEvent
    worker silent for `worker_timeout_s`: it leaves the pool; its prefill jobs go to another worker; what cannot
        go elsewhere (decode jobs: their state was only on that worker; a prefill with nowhere to go) gets a "lost"
        TokenEvent: the recipe, which holds every token streamed, resumes the request from them (an exact
        continuation, GenerateRequest.output_offset) or ends it with the event's 503
    a continuation is a new migration of its request (GenerateRequest.migration): its own message ids and
        assignments; a job or a done report of an earlier migration never replaces or drops a later one
    workers.done / requests.cancel / the next role taking over / a TTL: the assignment is forgotten
    every request it fails it also cancels on `requests.cancel` (every hop frees it); a lost worker gets a Cancel
        for itself alone (up to the migration it held) and, when it comes back, the same again, since its
        JetStream jobs are redelivered to the restarted instance and must not run for nobody

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
from collections.abc import Callable
from typing import Any

import orjson

from services.balancer.affinity import SessionAffinity
from services.balancer.assignments import Assignment, Assignments
from services.balancer.config import BalancerConfig
from services.balancer.experts.feed import ExpertsFeed
from services.balancer.experts.role import EXPERTS, ExpertsRole
from services.balancer.policies import POLICIES, Policy
from services.balancer.registry import WorkerRegistry
from services.balancer.roles import ROLES, Role, RoleContext
from shared import subjects, tracing
from shared.bus import Bus, Envelope, Retry, Subscription, WorkQueue
from services.balancer.kv_feed import KvEventFeed
from services.balancer.prefix_index import PrefixIndex
from shared.presence import announce_forever
from shared.schemas.balancer import BalancerStats, BalancerStatsReply, LostQuery, LostReply
from shared.schemas.generate import LOST, Cancel, TokenEvent
from shared.schemas.workers import Heartbeat, RequestDone

log = logging.getLogger(__name__)

LOST_MEMORY_S = 600.0  # how long what a lost worker held is kept, to tell it again when it returns


class BalancerService:
    name = "balancer"

    def __init__(self, config: BalancerConfig = BalancerConfig(), *, clock: Callable[[], float] = time.time) -> None:
        chosen = config.policies()
        self.index = PrefixIndex()
        self.affinity = SessionAffinity(config.affinity_ttl_s)
        context = RoleContext(self.index, self.affinity)
        self._roles: dict[str, Role[Any]] = {name: ROLES[name](context) for name in config.roles if name in ROLES}
        self._experts = ExpertsFeed(ExpertsRole(config.experts), clock) if EXPERTS in config.roles else None
        self._policies: dict[str, Policy] = {
            n: POLICIES[chosen.get(n, r.policy)](config.policy) for n, r in self._roles.items()
        }
        self.registry = WorkerRegistry(config.worker_timeout_s)
        self.assignments = Assignments()
        self._route_wait_s = config.route_wait_s
        self._retry_delay_s = config.retry_delay_s
        self._concurrency = config.concurrency
        self._max_reroutes = config.max_reroutes
        self._ttl_override = config.assignment_ttl_s
        self._clock = clock
        self._waiting: dict[tuple[str, str], float] = {}  # (request id, role) -> when it started waiting
        # worker -> request id -> (when, the Cancel to send it again when it returns): what it lost while gone
        self._lost_on: dict[str, dict[str, tuple[float, Cancel]]] = {}
        self.stats: Counter[str] = Counter()
        self._bus: Bus | None = None
        self._queues: list[WorkQueue] = []
        self._subs: list[Subscription] = []
        self._feed: KvEventFeed | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._presence: asyncio.Task[None] | None = None

    # --- Service protocol --------------------------------------------------------------------------------------

    async def start(self, bus: Bus) -> None:
        self._bus = bus
        self._subs = [
            await bus.subscribe(subjects.HEARTBEAT, Heartbeat, self._on_heartbeat),
            await bus.subscribe(subjects.WORKER_DONE, RequestDone, self._on_done),
            await bus.subscribe(subjects.CANCEL, Cancel, self._on_cancel),
            await bus.serve(subjects.BALANCER_STATS, BalancerStats, self._stats),  # every instance answers
            await bus.serve(subjects.BALANCER_LOST, LostQuery, self._lost),
        ]
        if self._experts is not None:
            await self._experts.start(bus)
        if "prefill" in self._roles:  # only prefill placement reads the caches' holdings
            self._feed = KvEventFeed(bus, self.index, clock=self._clock)
            await self._feed.start()
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
        self._presence = asyncio.create_task(announce_forever(bus, self.name, bus.name))

    async def stop(self) -> None:
        if self._presence is not None:
            self._presence.cancel()
        for queue in self._queues:
            await queue.stop()
        self._queues = []
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs = []
        if self._feed is not None:
            await self._feed.stop()
        if self._experts is not None:
            await self._experts.stop()
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)

    def health(self) -> tuple[bool, str]:
        detail = {
            "roles": list(self._roles) + ([EXPERTS] if self._experts is not None else []),
            "workers": self.registry.counts(),
            "assignments": len(self.assignments),
            "kv_sources": len(self.index.sources()),
            **self.stats,
            **({f"kv_{k}": v for k, v in self._feed.stats.items()} if self._feed is not None else {}),
            **({f"experts_{k}": v for k, v in self._experts.stats.items()} if self._experts else {}),
        }
        return self._bus is not None, orjson.dumps(detail).decode()

    async def _stats(self, _: BalancerStats) -> BalancerStatsReply:
        assert self._bus is not None
        return BalancerStatsReply(
            instance=self._bus.name,
            counters=dict(self.stats),
            workers=self.registry.counts(),
            assignments=len(self.assignments),
            kv_sources=len(self.index.sources()),
            kv_feed=dict(self._feed.stats) if self._feed is not None else {},
        )

    async def _lost(self, query: LostQuery) -> LostReply:
        """A worker starting up asks before it takes a job (its redelivered jobs may have moved on meanwhile); kept
        until it joins, when they are sent again (_recancel), for a worker that did not ask."""
        return LostReply([cancel for _, cancel in self._lost_on.get(query.worker_id, {}).values()])

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
        if role.follows is not None:  # the previous role's worker has handed the request on
            self.assignments.drop(rid, role.follows, migration=request.migration)
        placed = self.assignments.get(rid, role.name)
        if placed is not None and placed.migration >= request.migration:
            return  # a redelivery of a job already placed (its ack was lost), or of one the request moved past
        key = (rid, role.name)  # (an earlier migration's wait ended when its job was placed)
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
        workers = self.registry.candidates(role.name, request.model, now)
        demand = role.demand(job, workers, now)
        choice = self._policies[role.name].choose(workers, demand)
        if choice is None:
            return None
        worker = choice.worker_id
        pending = self.registry.assign(worker, demand.uncached(worker), demand.blocks_needed, now)
        ttl = self._ttl_override if self._ttl_override is not None else role.assignment_ttl_s
        assignment = Assignment(
            request_id=request.request_id,
            role=role.name,
            worker_id=worker,
            job=job if role.reroutable else None,
            at=now,
            expires_at=now + ttl,
            attempt=attempt,
            migration=request.migration,
            trace=tracing.current(),
        )
        self.assignments.add(assignment)
        subject, message = role.address(job, worker)
        msg_id = (f"{request.request_id}:{role.name}" + (f":m{request.migration}" if request.migration else "")
                  + (f":{attempt}" if attempt else ""))
        try:
            await self._bus.submit(subject, message, msg_id=msg_id)
        except Exception:
            if pending is not None:
                self.registry.unassign(worker, pending)
            self.assignments.drop(request.request_id, role.name, worker)
            raise
        role.placed(job, worker, now)
        self.stats[f"routed_{role.name}"] += 1
        self.stats[f"prompt_tokens_{role.name}"] += len(request.prompt_ids)  # the hit ratios' denominator
        # prompt tokens the chosen worker found in its own cache / would load from the store (hit ratios)
        if local := demand.local(worker):
            self.stats[f"local_hit_tokens_{role.name}"] += local
        if stored := sum(demand.store_tokens.get(worker, {}).values()):
            self.stats[f"store_hit_tokens_{role.name}"] += stored
        if demand.affinity and demand.affinity == worker:
            self.stats[f"affinity_{role.name}"] += 1
        return worker

    def _wait_start(self, role: Role[Any], arrival: float, now: float) -> float:
        # The first hop counts from the gateway's arrival stamp (time already spent queued counts); later hops
        # from when this balancer first saw the job, since prefill itself may have taken long. min() bounds the
        # wait even when the gateway's clock runs ahead of ours.
        if role.follows is None and arrival > 0:
            return min(arrival, now)
        return now

    async def _fail(self, request_id: str, error: str) -> None:
        """End a request with an explicit error, so the client gets a 503 rather than a hang, and cancel it: a
        worker that still holds it (silent, not dead) or gets it again must not work for nobody."""
        assert self._bus is not None
        # Index 0: the balancer does not know how far the request got. Consumers end a stream on any error event.
        event = TokenEvent(request_id, index=0, token_ids=[], finish_reason="error", error=error, error_status=503)
        await self._bus.publish(subjects.tokens(request_id), event)
        await self._bus.publish(subjects.CANCEL, Cancel(request_id, reason=error))

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
            if self._feed is not None:
                self._feed.forget(worker_id)  # its local cache went with it (a restart resyncs from a snapshot)
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
        self.affinity.expire(now)
        if self._feed is not None:
            self._feed.expire(now)
        self._waiting = {k: t for k, t in self._waiting.items() if now - t < 2 * self._route_wait_s + 60}
        for worker_id, lost in list(self._lost_on.items()):  # a worker that never comes back
            self._lost_on[worker_id] = {r: e for r, e in lost.items() if now - e[0] < LOST_MEMORY_S}
            if not self._lost_on[worker_id]:
                del self._lost_on[worker_id]

    async def _recover(self, lost: Assignment, now: float) -> None:
        """The lost worker lets go (it may be only silent: it stops now, not when it finishes for nobody; and it
        is told again when it returns), and the job goes to another worker, or back to the recipe to resume."""
        role = self._roles.get(lost.role)
        if role is None:
            return
        with tracing.within(f"balancer recover {lost.role}", lost.trace):
            worker = None
            if role.reroutable and lost.job is not None and lost.attempt < self._max_reroutes:
                try:
                    worker = await self._place(role, lost.job, now, attempt=lost.attempt + 1)
                except Exception:
                    log.exception("re-routing %s failed", lost.request_id)
            reason = "re-routed" if worker is not None else "worker lost"
            moved = Cancel(lost.request_id, reason, worker_id=lost.worker_id, migration=lost.migration,
                           role=lost.role)
            self._lost_on.setdefault(lost.worker_id, {})[lost.request_id] = (now, moved)
            assert self._bus is not None
            await self._bus.publish(subjects.CANCEL, moved)
            if worker is not None:
                log.info("re-routed %s %s from %s to %s", lost.role, lost.request_id, lost.worker_id, worker)
                self.stats["rerouted"] += 1
                return
            log.info("%s %s lost with %s (migration %d): handed back to resume", lost.role, lost.request_id,
                     lost.worker_id, lost.migration)
            self.stats["released_worker_lost"] += 1
            # Index 0: the balancer does not know how far the request got (the recipe does).
            event = TokenEvent(lost.request_id, index=0, token_ids=[], finish_reason=LOST, error="worker lost",
                               error_status=503, migration=lost.migration)
            await self._bus.publish(subjects.tokens(lost.request_id), event)

    # --- broadcasts --------------------------------------------------------------------------------------------

    async def _on_heartbeat(self, beat: Heartbeat, _: Envelope) -> None:
        if self.registry.observe(beat, self._clock()):
            log.info("worker %s (%s, %s) joined the pool", beat.worker_id, beat.role, beat.model)
            await self._recancel(beat.worker_id)

    async def _recancel(self, worker_id: str) -> None:
        """A worker back after being lost (restarted: the Cancels sent meanwhile never reached it) is told again
        which of its requests ended or moved on, before the redeliveries of their jobs would run them again."""
        assert self._bus is not None
        for _, cancel in self._lost_on.pop(worker_id, {}).values():
            await self._bus.publish(subjects.CANCEL, cancel)

    async def _on_done(self, done: RequestDone, _: Envelope) -> None:
        self.assignments.drop(done.request_id, done.role, done.worker_id, migration=done.migration)
        if done.role == "decode":
            self.affinity.done(done.request_id, done.worker_id, self._clock())

    async def _on_cancel(self, cancel: Cancel, _: Envelope) -> None:
        if cancel.worker_id:
            return  # one worker letting go of a request that moved on (our own re-route): it lives on
        self.assignments.cancel(cancel.request_id, list(self._roles), self._clock())
        for role in self._roles:
            self._waiting.pop((cancel.request_id, role), None)
