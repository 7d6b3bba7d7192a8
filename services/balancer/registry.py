"""The worker pool as this balancer knows it: last heartbeat of each worker, plus the work sent since.

Pure bookkeeping, no I/O, and time comes in as `now` (unix seconds), so it is tested with a fake clock.

A heartbeat reports the load a worker had when it sent it. Work this balancer assigned after that moment is not
in the report yet, so each worker carries a `pending` list of such assignments: a burst of requests spreads
over the pool before the next heartbeat catches up, instead of all landing on the worker that looked idlest.
A heartbeat clears the assignments stamped before its `sent_at` (it reflects them, or will never see them).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from shared.schemas.workers import Heartbeat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerLoad:
    """One worker as a policy sees it."""

    worker_id: str
    role: str
    model: str
    queued_tokens: int  # reported: prompt tokens waiting or being computed
    running: int  # reported: sequences held
    free_blocks: int  # reported
    total_blocks: int
    pending_tokens: int = 0  # assigned by this balancer since the heartbeat was sent
    pending_requests: int = 0
    pending_blocks: int = 0
    cache_id: str = ""  # how it names KV blocks (shared/hashing.py); "" = unknown
    block_tokens: int = 0


@dataclass(frozen=True)
class Pending:
    at: float
    tokens: int
    blocks: int


@dataclass
class _Worker:
    beat: Heartbeat
    last_seen: float  # our clock, not the worker's: expiry must not depend on clock skew
    pending: list[Pending] = field(default_factory=list)

    def load(self) -> WorkerLoad:
        b = self.beat
        return WorkerLoad(
            worker_id=b.worker_id,
            role=b.role,
            model=b.model,
            queued_tokens=b.queued_tokens,
            running=b.running,
            free_blocks=b.free_blocks,
            total_blocks=b.total_blocks,
            pending_tokens=sum(p.tokens for p in self.pending),
            pending_requests=len(self.pending),
            pending_blocks=sum(p.blocks for p in self.pending),
            cache_id=b.cache_id,
            block_tokens=b.block_tokens,
        )


class WorkerRegistry:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._workers: dict[str, _Worker] = {}

    def observe(self, beat: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True when the worker (re)joins the pool."""
        worker = self._workers.get(beat.worker_id)
        if worker is None:
            self._workers[beat.worker_id] = _Worker(beat, now)
            return True
        worker.last_seen = now
        if beat.sent_at >= worker.beat.sent_at:  # an older beat overtaken on the wire says nothing new
            worker.beat = beat
            worker.pending = [p for p in worker.pending if p.at > beat.sent_at]
        return False

    def expire(self, now: float) -> list[str]:
        """Drop workers silent for longer than the timeout; returns their ids."""
        gone = [w for w, s in self._workers.items() if now - s.last_seen > self.timeout_s]
        for worker_id in gone:
            del self._workers[worker_id]
        return gone

    def candidates(self, role: str, model: str, now: float) -> list[WorkerLoad]:
        """Live workers of `role` serving `model`, sorted by id (a stable order for tie-breaks)."""
        return [
            s.load()
            for w, s in sorted(self._workers.items())
            if s.beat.role == role and s.beat.model == model and now - s.last_seen <= self.timeout_s
        ]

    def assign(self, worker_id: str, tokens: int, blocks: int, now: float) -> Pending | None:
        worker = self._workers.get(worker_id)
        if worker is None:
            return None
        pending = Pending(now, tokens, blocks)
        worker.pending.append(pending)
        return pending

    def unassign(self, worker_id: str, pending: Pending) -> None:
        """Undo an assignment whose job was never sent."""
        worker = self._workers.get(worker_id)
        if worker is not None and pending in worker.pending:
            worker.pending.remove(pending)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def counts(self) -> dict[str, int]:
        return dict(Counter(s.beat.role for s in self._workers.values()))
