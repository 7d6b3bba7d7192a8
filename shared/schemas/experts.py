"""workers -> balancer: per-expert routing counts; balancer -> workers: the expert placement to run (the
`experts` role, services/balancer/experts/).

    experts.load   ExpertLoad, core NATS, every few seconds from each worker whose model routes to experts
    experts.plan   ExpertPlan, core NATS broadcast; a worker takes the plans of its own group

A worker group is the GPUs one placement spans: the ranks of one worker (expert parallelism), named by the
worker's id. Counts are windows (the pairs routed since the previous report), so a lost message loses one window
and nothing else; the balancer sums the windows of its sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertLoad:
    worker_id: str
    role: str  # "prefill" | "decode"
    model: str
    group: str  # the worker group this worker's GPUs belong to
    layers: int
    experts: int  # logical (routed) experts per layer
    # token-expert pairs the router chose in the window, counts[layer * experts + expert]; layers * experts long
    counts: list[int]
    window_s: float  # how long the window ran
    sent_at: float
    # the group's GPUs and physical expert slots: nodes x ranks_per_node GPUs, experts + redundant_slots slots
    nodes: int = 1
    ranks_per_node: int = 1
    redundant_slots: int = 0
    expert_bytes: int = 0  # one routed expert's weights as loaded (FP4 + scales, or dense): what a move costs
    plan_version: int = 0  # the ExpertPlan the group runs (0: the initial placement, expert e in slot e)


@dataclass(frozen=True)
class ExpertPlan:
    """Where every physical expert slot of a group points, layer by layer:

        physical[layer][slot] = the logical expert held in `slot`     slot s lives on rank s // slots_per_rank

    A worker applies it between two steps: it loads the replicas a rank lacks beside the running ones, then
    switches each layer's routing table (logical expert -> its slots, `slots_of`, a token going to one of them)
    at once. The first plan for a group (version 1) always comes, even when it changes nothing."""

    group: str
    model: str
    version: int  # 1, 2, ... per group and balancer run
    layers: int
    experts: int
    ranks: int
    slots_per_rank: int
    physical: list[list[int]]  # (layers, ranks * slots_per_rank)
    moved_bytes: int  # expert weights the GPUs load to go from the previous plan to this one
    layers_changed: int
    imbalance_before: float  # mean over layers of max / mean GPU load, running placement, under the window
    imbalance_after: float  # the same for this plan
    planned_at: float

    def slots_of(self, layer: int) -> list[list[int]]:
        """logical expert -> the physical slots holding it, for one layer (every expert has at least one)."""
        out: list[list[int]] = [[] for _ in range(self.experts)]
        for slot, expert in enumerate(self.physical[layer]):
            out[expert].append(slot)
        return out
