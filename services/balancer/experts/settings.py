"""The experts role's knobs, built once from the balancer's flags (the fields are flags: shared/config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from services.balancer.experts.plan import POLICIES
from shared.config import option


@dataclass(frozen=True)
class ExpertsSettings:
    experts_window_s: float = option(300.0, help="s of routing counts a placement is planned from (sliding window)")
    experts_period_s: float = option(600.0, help="s between two re-plans of a worker group's expert placement")
    experts_imbalance: float = option(
        1.3, help="re-plan before the period is over when the running placement's max/mean GPU load (mean over "
                  "layers) passes this")
    experts_min_interval_s: float = option(30.0, help="s at least between two re-plans of a group")
    experts_min_gain: float = option(
        0.05, help="a layer keeps its placement unless a re-plan lowers its max/mean GPU load by more than this "
                   "(moving expert weights costs)")
    experts_policy: str = option(
        "best", choices=POLICIES, help="hierarchical (DeepSeek's EPLB: expert groups to nodes, replicas within a "
                                       "node) | global (replicas anywhere) | best (either, per layer)")
    experts_min_tokens: int = 1  # a window with fewer token-expert pairs than this plans nothing (an idle group)

    def __post_init__(self) -> None:
        if min(self.experts_window_s, self.experts_period_s, self.experts_imbalance) <= 0:
            raise ValueError("expert window, period and imbalance threshold must be positive")
        if self.experts_min_gain < 0 or self.experts_min_interval_s < 0:
            raise ValueError("expert min gain and min interval must be >= 0")
