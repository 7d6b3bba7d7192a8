"""Role plug-ins: what the balancer routes for each kind of worker, chosen by name (`--roles prefill,decode`).

A role says where its jobs come from (a JetStream route queue), what they ask of a worker (a `Demand`), which
policy places them, and how a placed job is addressed to its worker. The routing loop itself (service.py) is
the same for every role. Vision and expert placement plug in here later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from services.balancer.policies import Demand
from shared import subjects
from shared.schemas.generate import DecodeJob, GenerateRequest, PrefillJob

J = TypeVar("J")


class Role(Protocol[J]):
    name: str  # also the worker role in heartbeats
    route_subject: str
    durable: str
    job_type: type[J]
    policy: str  # a name in policies.POLICIES
    reroutable: bool  # may a job lost with its worker be recomputed elsewhere
    follows: str | None  # the role whose part of a request is over once a job of this role arrives
    assignment_ttl_s: float  # forget an assignment never reported done after this long

    def request(self, job: J) -> GenerateRequest: ...

    def demand(self, job: J) -> Demand: ...

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

    def request(self, job: GenerateRequest) -> GenerateRequest:
        return job

    def demand(self, job: GenerateRequest) -> Demand:
        return Demand(prompt_tokens=len(job.prompt_ids))

    def address(self, job: GenerateRequest, worker_id: str) -> tuple[str, PrefillJob]:
        return subjects.prefill_work(worker_id), PrefillJob(job, worker_id)


class DecodeRole:
    name: str = "decode"
    route_subject: str = subjects.ROUTE_DECODE
    durable: str = subjects.BALANCER_DECODE_DURABLE
    job_type: type[DecodeJob] = DecodeJob
    policy: str = "most-free-blocks"
    reroutable: bool = False  # the generated tokens live only on the lost worker: fail, the client retries
    follows: str | None = "prefill"
    assignment_ttl_s: float = 3600.0  # long generations run for many minutes

    def request(self, job: DecodeJob) -> GenerateRequest:
        return job.request

    def demand(self, job: DecodeJob) -> Demand:
        # The prompt plus the first token must fit; later blocks are the worker's to find (or preempt for).
        # Counted in the model's own blocks (DeepSeek-V4: 128 tokens, not shared.hashing's 16), which prefill
        # already did: block_hashes has one key per full prompt block, and ceil((n + 1) / B) = n // B + 1.
        tokens = len(job.request.prompt_ids) + 1
        return Demand(prompt_tokens=tokens, blocks_needed=len(job.block_hashes) + 1)

    def address(self, job: DecodeJob, worker_id: str) -> tuple[str, DecodeJob]:
        return subjects.decode_work(worker_id), dataclasses.replace(job, worker_id=worker_id)


ROLES: dict[str, Callable[[], Role[Any]]] = {PrefillRole.name: PrefillRole, DecodeRole.name: DecodeRole}
