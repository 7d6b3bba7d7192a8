"""Role plug-ins: what the balancer routes for each kind of worker, chosen by name (`--roles prefill,decode`).

A role says where its jobs come from (a JetStream route queue), what they ask of each candidate worker (a
`Demand`: prefill fills in what each worker has cached of the prompt, decode which worker served the previous
turn), which policy places them by default, and how a placed job is addressed to its worker. The routing loop
itself (service.py) is the same for every role. Vision plugs in here later; expert placement routes no jobs and
is its own module (experts/: `--roles ...,experts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from services.balancer.affinity import SessionAffinity
from services.balancer.policies import Demand
from services.balancer.prefix import prefix_hits
from services.balancer.registry import WorkerLoad
from shared import subjects
from services.balancer.prefix_index import PrefixIndex
from shared.schemas.generate import DecodeJob, GenerateRequest, PrefillJob

J = TypeVar("J")


@dataclass(frozen=True)
class RoleContext:
    """What the balancer knows beyond the worker pool, shared by the roles that use it."""

    index: PrefixIndex  # every cache's holdings, fed by KV events
    affinity: SessionAffinity  # which decode worker served which turn


class Role(Protocol[J]):
    name: str  # also the worker role in heartbeats
    route_subject: str
    durable: str
    job_type: type[J]
    policy: str  # a name in policies.POLICIES
    reroutable: bool  # may a job lost with its worker be placed again as it is (else: the recipe resumes it)
    follows: str | None  # the role whose part of a request is over once a job of this role arrives
    assignment_ttl_s: float  # forget an assignment never reported done after this long

    def request(self, job: J) -> GenerateRequest: ...

    def demand(self, job: J, workers: Sequence[WorkerLoad], now: float) -> Demand:
        """What `job` asks of a worker, and what each of `workers` (the candidates) already has of it."""
        ...

    def placed(self, job: J, worker_id: str, now: float) -> None:
        """`job` went to `worker_id` (remember what later placements need)."""
        ...

    def address(self, job: J, worker_id: str) -> tuple[str, Any]:
        """(work subject, message) that hands `job` to `worker_id`."""
        ...


class PrefillRole:
    name: str = "prefill"
    route_subject: str = subjects.ROUTE_PREFILL
    durable: str = subjects.BALANCER_PREFILL_DURABLE
    job_type: type[GenerateRequest] = GenerateRequest
    policy: str = "least-cost"
    reroutable: bool = True  # a prompt's KV can always be recomputed
    follows: str | None = None
    assignment_ttl_s: float = 600.0  # a prefill longer than this is broken anyway

    def __init__(self, context: RoleContext) -> None:
        self._index = context.index

    def request(self, job: GenerateRequest) -> GenerateRequest:
        return job

    def demand(self, job: GenerateRequest, workers: Sequence[WorkerLoad], now: float) -> Demand:
        hits = prefix_hits(self._index, job.prompt_ids, job.cache_salt, workers)
        return Demand(prompt_tokens=len(job.prompt_ids), cached_tokens=hits.local, store_tokens=hits.store)

    def placed(self, job: GenerateRequest, worker_id: str, now: float) -> None:
        pass  # the worker's own KV events will say what it cached

    def address(self, job: GenerateRequest, worker_id: str) -> tuple[str, PrefillJob]:
        return subjects.prefill_work(worker_id), PrefillJob(job, worker_id)


class DecodeRole:
    name: str = "decode"
    route_subject: str = subjects.ROUTE_DECODE
    durable: str = subjects.BALANCER_DECODE_DURABLE
    job_type: type[DecodeJob] = DecodeJob
    policy: str = "affinity"
    # its KV and position live only on the lost worker: handed back to the recipe, which resumes it from the
    # tokens it streamed (a continuation through prefill, GenerateRequest.output_offset)
    reroutable: bool = False
    follows: str | None = "prefill"
    assignment_ttl_s: float = 3600.0  # long generations run for many minutes

    def __init__(self, context: RoleContext) -> None:
        self._affinity = context.affinity

    def request(self, job: DecodeJob) -> GenerateRequest:
        return job.request

    def demand(self, job: DecodeJob, workers: Sequence[WorkerLoad], now: float) -> Demand:
        # The prompt plus the first token must fit; later blocks are the worker's to find (or preempt for).
        # Counted in the model's own blocks (DeepSeek-V4: 128 tokens, not shared.hashing's 16), which prefill
        # already did: block_hashes has one key per full prompt block, and ceil((n + 1) / B) = n // B + 1.
        prompt = job.request.prompt_ids
        owner = self._affinity.owner(prompt, job.block_hashes, now)
        return Demand(prompt_tokens=len(prompt) + 1, blocks_needed=len(job.block_hashes) + 1, affinity=owner)

    def placed(self, job: DecodeJob, worker_id: str, now: float) -> None:
        self._affinity.remember(job.request.request_id, job.request.prompt_ids, job.block_hashes, worker_id, now)

    def address(self, job: DecodeJob, worker_id: str) -> tuple[str, DecodeJob]:
        return subjects.decode_work(worker_id), dataclasses.replace(job, worker_id=worker_id)


ROLES: dict[str, Callable[[RoleContext], Role[Any]]] = {PrefillRole.name: PrefillRole, DecodeRole.name: DecodeRole}
