"""Decode placement: back to the worker that served the conversation's previous turn when it has room, else the
worker with the most free KV blocks, then the fewest running sequences.

    free(w)    = free_blocks(w) - pending_blocks(w)      blocks not yet promised to a job
    running(w) = running(w) + pending_requests(w)
    fits       = {w : free(w) >= blocks_needed}
    choice     = demand.affinity if it is in fits,
                 else argmin over fits of (-free(w), running(w), worker_id)

`pending_*` count jobs this balancer sent w after w's last heartbeat (see registry.py). A worker without room
for the prompt's KV is never chosen, not even for affinity: when none has room the job waits (the caller
retries) rather than overcommitting a worker into preemption. The affinity hint comes from affinity.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.balancer.policies.base import Demand, PolicySettings
from services.balancer.registry import WorkerLoad


def free_blocks(worker: WorkerLoad) -> int:
    return worker.free_blocks - worker.pending_blocks


def running(worker: WorkerLoad) -> int:
    return worker.running + worker.pending_requests


class MostFreeBlocks:
    name = "most-free-blocks"

    @classmethod
    def from_settings(cls, settings: PolicySettings = PolicySettings()) -> MostFreeBlocks:
        return cls()

    def choose(self, workers: Sequence[WorkerLoad], demand: Demand) -> WorkerLoad | None:
        fits = [w for w in workers if free_blocks(w) >= demand.blocks_needed]
        if not fits:
            return None
        return min(fits, key=lambda w: (-free_blocks(w), running(w), w.worker_id))


class AffinityThenFreeBlocks(MostFreeBlocks):
    name = "affinity"

    @classmethod
    def from_settings(cls, settings: PolicySettings = PolicySettings()) -> AffinityThenFreeBlocks:
        return cls()

    def choose(self, workers: Sequence[WorkerLoad], demand: Demand) -> WorkerLoad | None:
        if demand.affinity:
            for w in workers:
                if w.worker_id == demand.affinity and free_blocks(w) >= demand.blocks_needed:
                    return w
        return super().choose(workers, demand)
