"""Placement policies by name: each role names the one it uses (see roles.py)."""

from __future__ import annotations

from collections.abc import Callable

from services.balancer.policies.base import Demand, Policy
from services.balancer.policies.decode import MostFreeBlocks
from services.balancer.policies.prefill import LeastCost

POLICIES: dict[str, Callable[[], Policy]] = {
    LeastCost.name: LeastCost,
    MostFreeBlocks.name: MostFreeBlocks,
}

__all__ = ["POLICIES", "Demand", "Policy"]
