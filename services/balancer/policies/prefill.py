"""Prefill placement: the worker that would reach this prompt's first token soonest.

    cost(w) = (prompt_tokens - cached_tokens(w))            tokens w must compute for this prompt
            + (queued_tokens(w) + pending_tokens(w))         tokens already ahead of it on w

`pending_tokens` is what this balancer sent w after w's last heartbeat (see registry.py). With no cache
information `cached_tokens` is 0 everywhere and the first term is the same for every worker: least load. Cache-
aware routing fills `Demand.cached_tokens` and weighs it with `overlap_weight` (Dynamo's form; DESIGN.md §6).
Ties go to the smallest worker id, so the choice is stable and reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.balancer.policies.base import Demand
from services.balancer.registry import WorkerLoad


def prefill_cost(worker: WorkerLoad, demand: Demand, overlap_weight: float = 1.0) -> float:
    cached = min(demand.cached_tokens.get(worker.worker_id, 0), demand.prompt_tokens)
    to_compute = demand.prompt_tokens - overlap_weight * cached
    queued = worker.queued_tokens + worker.pending_tokens
    return to_compute + queued


class LeastCost:
    name = "least-cost"

    def __init__(self, overlap_weight: float = 1.0) -> None:
        self.overlap_weight = overlap_weight

    def choose(self, workers: Sequence[WorkerLoad], demand: Demand) -> WorkerLoad | None:
        if not workers:
            return None
        return min(workers, key=lambda w: (prefill_cost(w, demand, self.overlap_weight), w.worker_id))
