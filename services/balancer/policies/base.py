"""The seam between routing and decisions: a policy takes a snapshot of candidate workers and a demand, and
returns a choice (or None when no worker can take the job). No I/O, no clock; the cache-aware and load policies
hold nothing beyond their settings (round-robin keeps a cursor, random its generator)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.balancer.registry import WorkerLoad
from shared.config import option
from shared.schemas.events import TIER_LMDB, TIER_RAM, TIER_SSD


@dataclass(frozen=True)
class Demand:
    """What a job asks of a worker, and what each worker already has of it."""

    prompt_tokens: int
    blocks_needed: int = 0  # KV blocks the job must hold on the worker; 0 = unknown
    # worker id -> prompt tokens in that worker's local prefix cache (reused for free)
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    # worker id -> tier -> prompt tokens past its local run that it would load from the shared store
    store_tokens: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    affinity: str = ""  # the worker that served this conversation's previous turn ("" = none known)

    def local(self, worker_id: str) -> int:
        return min(self.cached_tokens.get(worker_id, 0), self.prompt_tokens)

    def uncached(self, worker_id: str) -> int:
        """Prompt tokens `worker_id` would compute itself."""
        loaded = sum(self.store_tokens.get(worker_id, {}).values())
        return max(self.prompt_tokens - self.local(worker_id) - loaded, 0)


@dataclass(frozen=True)
class PolicySettings:
    """The knobs of every policy, built once from the balancer's flags (its fields are flags: shared/config.py);
    each policy reads the ones it needs.

    Store weights are what loading a block from a tier costs, as a fraction of computing it. Bandwidth alone
    puts them near 0.01 for DeepSeek-V4-Flash (a 128-token block is ~450 KB against ~3 TFLOP of compute), but
    end-to-end measurements are less rosy: LMCache reports 3-10x TTFT savings when prefix KV comes from host
    memory or local disk instead of being recomputed, i.e. a load costs 0.1-0.33 of recomputing, and our path
    adds a NATS hop and copies. So RAM takes the low end of that range, SSD the middle and LMDB (memory-mapped:
    page cache when warm, disk when cold) sits between; all are flags, for the Mooncake replay benchmark to
    calibrate.
    """

    overlap_weight: float = option(  # Dynamo's: how much a cached token is worth against a queued one
        1.0, help="worth of a cached prompt token against a queued one (0 ignores caches)")
    ram_weight: float = option(
        0.1, help="cost of loading a block from the store's RAM tier, as a fraction of computing it")
    lmdb_weight: float = option(0.15, help="the same, LMDB tier")
    ssd_weight: float = option(0.25, help="the same, SSD tier")  # also used for any tier this balancer does not know
    seed: int | None = option(None, help="seed of the random policy")  # the random policy's generator

    def __post_init__(self) -> None:
        tiers = (self.ram_weight, self.lmdb_weight, self.ssd_weight)
        if self.overlap_weight < 0 or not all(0 <= w <= 1 for w in tiers):
            raise ValueError("overlap weight must be >= 0 and tier weights within [0, 1]")

    def tier_weights(self) -> dict[str, float]:
        return {TIER_RAM: self.ram_weight, TIER_LMDB: self.lmdb_weight, TIER_SSD: self.ssd_weight}


class Policy(Protocol):
    name: str

    def choose(self, workers: Sequence[WorkerLoad], demand: Demand) -> WorkerLoad | None: ...
