"""Decode placement: the worker with the most free KV blocks, then the fewest running sequences.

    free(w)    = free_blocks(w) - pending_blocks(w)      blocks not yet promised to a job
    running(w) = running(w) + pending_requests(w)
    choice     = argmin over {w : free(w) >= blocks_needed} of (-free(w), running(w), worker_id)

`pending_*` count jobs this balancer sent w after w's last heartbeat (see registry.py). A worker without room
for the prompt's KV is never chosen: when none has room the job waits (the caller retries) rather than
overcommitting a worker into preemption.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.balancer.policies.base import Demand
from services.balancer.registry import WorkerLoad


def free_blocks(worker: WorkerLoad) -> int:
    return worker.free_blocks - worker.pending_blocks


def running(worker: WorkerLoad) -> int:
    return worker.running + worker.pending_requests


class MostFreeBlocks:
    name = "most-free-blocks"

    def choose(self, workers: Sequence[WorkerLoad], demand: Demand) -> WorkerLoad | None:
        fits = [w for w in workers if free_blocks(w) >= demand.blocks_needed]
        if not fits:
            return None
        return min(fits, key=lambda w: (-free_blocks(w), running(w), w.worker_id))
