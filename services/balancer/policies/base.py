"""The seam between routing and decisions: a policy takes a snapshot of candidate workers and a demand, and
returns a choice (or None when no worker can take the job). No I/O, no clock, no state beyond its settings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.balancer.registry import WorkerLoad


@dataclass(frozen=True)
class Demand:
    """What a job asks of a worker."""

    prompt_tokens: int
    blocks_needed: int = 0  # KV blocks the job must hold on the worker; 0 = unknown
    # worker id -> prompt tokens already cached there. Empty until cache-aware routing feeds it.
    cached_tokens: Mapping[str, int] = field(default_factory=dict)


class Policy(Protocol):
    name: str

    def choose(self, workers: Sequence[WorkerLoad], demand: Demand) -> WorkerLoad | None: ...
