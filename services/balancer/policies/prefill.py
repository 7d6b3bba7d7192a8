"""Prefill placement. The default is cache-aware: the worker that would reach this prompt's first token soonest.

    saved(w)  = local(w)                                      prompt tokens in w's own prefix cache: free
              + sum over tiers t of (1 - weight_t) * store_t(w)   tokens past local(w) that w loads from the
                                                                  shared store instead of computing
    cost(w)   = prompt_tokens - overlap_weight * saved(w)     what w must still compute (or load, weighed)
              + queued_tokens(w) + pending_tokens(w)          tokens already ahead of it on w

`weight_t` is a load from tier t as a fraction of computing the block (PolicySettings). Because every worker
sees the same shared store, the store term matters where local runs differ: a block w holds locally costs it
nothing, the same block read from the store costs weight_t. `pending_tokens` is what this balancer sent w after
w's last heartbeat (registry.py). With no cache information the first term is the same everywhere: least load.
`overlap_weight` is Dynamo's (DESIGN.md §6): 0 ignores caches. Ties go to the smallest worker id.

Round-robin and random ignore both caches and load: the baselines the Mooncake replay benchmark compares against.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from services.balancer.policies.base import Demand, PolicySettings
from services.balancer.registry import WorkerLoad

DEFAULT_TIER_WEIGHTS = PolicySettings().tier_weights()


def prefill_cost(
    worker: WorkerLoad,
    demand: Demand,
    overlap_weight: float = 1.0,
    tier_weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
) -> float:
    unknown = max(tier_weights.values(), default=1.0)  # a tier we know nothing of: the slowest we know
    store = demand.store_tokens.get(worker.worker_id, {})
    saved = demand.local(worker.worker_id) + sum((1 - tier_weights.get(t, unknown)) * n for t, n in store.items())
    queued = worker.queued_tokens + worker.pending_tokens
    return demand.prompt_tokens - overlap_weight * min(saved, demand.prompt_tokens) + queued


class LeastCost:
    name = "least-cost"

    def __init__(self, overlap_weight: float = 1.0, tier_weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS) -> None:
        self.overlap_weight = overlap_weight
        self.tier_weights = dict(tier_weights)

    @classmethod
    def from_settings(cls, settings: PolicySettings = PolicySettings()) -> LeastCost:
        return cls(settings.overlap_weight, settings.tier_weights())

    def choose(self, workers: Sequence[WorkerLoad], demand: Demand) -> WorkerLoad | None:
        if not workers:
            return None
        return min(
            workers, key=lambda w: (prefill_cost(w, demand, self.overlap_weight, self.tier_weights), w.worker_id)
        )


class RoundRobin:
    """Each job to the next worker in id order (the pool may change between jobs: the cursor just moves on)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    @classmethod
    def from_settings(cls, settings: PolicySettings = PolicySettings()) -> RoundRobin:
        return cls()

    def choose(self, workers: Sequence[WorkerLoad], demand: Demand) -> WorkerLoad | None:
        if not workers:
            return None
        choice = sorted(workers, key=lambda w: w.worker_id)[self._next % len(workers)]
        self._next += 1
        return choice


class Random:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    @classmethod
    def from_settings(cls, settings: PolicySettings = PolicySettings()) -> Random:
        return cls(settings.seed)

    def choose(self, workers: Sequence[WorkerLoad], demand: Demand) -> WorkerLoad | None:
        if not workers:
            return None
        return self._rng.choice(sorted(workers, key=lambda w: w.worker_id))
