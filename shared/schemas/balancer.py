"""gateway -> balancer: the routing statistics, for /metrics; worker -> balancer: what it missed while lost."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.schemas.generate import Cancel


@dataclass(frozen=True)
class BalancerStats:
    """On `balancer.stats`: every balancer instance answers for itself (the gateway shows the first reply)."""


@dataclass(frozen=True)
class BalancerStatsReply:
    instance: str
    # since start: routed_<role>, prompt_tokens_<role>, local_hit_tokens_<role>, store_hit_tokens_<role>,
    # affinity_<role>, rerouted, workers_lost, failed_no_worker, released_worker_lost (handed back to the recipe
    # to resume), failed_worker_lost (no longer counted: a lost worker's requests are resumed, not failed)
    counters: dict[str, int] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)  # role -> workers in the pool now
    assignments: int = 0  # requests placed and not done yet
    kv_sources: int = 0  # KV event sources in the prefix index
    kv_feed: dict[str, int] = field(default_factory=dict)  # the KV event feed's counters: events, gaps, resyncs...


@dataclass(frozen=True)
class LostQuery:
    """On `balancer.lost`, from a worker starting up, before it takes its first job: the jobs JetStream redelivers
    to a restarted worker may be of requests that moved on while it was lost (re-routed, resumed elsewhere)."""

    worker_id: str


@dataclass(frozen=True)
class LostReply:
    cancels: list[Cancel] = field(default_factory=list)  # sent while `worker_id` was lost: it lets go of them first
