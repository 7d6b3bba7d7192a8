"""Placement policies by name: each role names its default (see roles.py); `--prefill-policy` and
`--decode-policy` choose another. A factory takes the balancer's PolicySettings and reads what it needs."""

from __future__ import annotations

from collections.abc import Callable

from services.balancer.policies.base import Demand, Policy, PolicySettings
from services.balancer.policies.decode import AffinityThenFreeBlocks, MostFreeBlocks
from services.balancer.policies.prefill import LeastCost, Random, RoundRobin

POLICIES: dict[str, Callable[..., Policy]] = {
    p.name: p.from_settings for p in (LeastCost, RoundRobin, Random, MostFreeBlocks, AffinityThenFreeBlocks)
}

__all__ = ["POLICIES", "Demand", "Policy", "PolicySettings"]
