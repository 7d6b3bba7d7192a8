"""Expert placement, one MoE layer at a time: DeepSeek's EPLB (github.com/deepseek-ai/EPLB), hierarchical.

Given a layer's per-expert loads (token-expert pairs routed in a window) and a worker group of `nodes` x
`ranks_per_node` GPUs holding `slots` physical expert slots (every logical expert once, plus a redundant
budget), choose how many replicas each expert gets and which GPU holds each replica:

    1. expert groups to nodes: the groups (each `experts / groups` consecutive experts) are packed onto the
       nodes, groups / nodes each, balancing the nodes' loads (a group's tokens then stay inside one node);
    2. replicas within each node: its slots / nodes slots go one to each of its experts, then one at a time to
       the expert with the most load per replica (this minimises the largest per-replica load);
    3. replicas to GPUs: the node's replicas are packed onto its GPUs, slots / ranks each, balancing their loads.

    packing (1, 3)  heaviest item first, into the least-loaded bin that still has room (ties: the lower bin)
    load(GPU)       sum over its slots of load[e] / replicas[e]   (an expert's tokens split evenly over replicas)
    imbalance       max over GPUs / mean over GPUs                (1 is perfect)

When the groups do not divide among the nodes, the whole group of GPUs is planned as one node (EPLB's global
policy); `policy="global"` always does, `"best"` plans both ways and keeps, layer by layer, the better one.
Without group-limited routing (DeepSeek-V4) every expert is its own group: step 1 packs experts, and keeping a
hot expert's replicas inside one node (the hierarchical scheme) caps its spread at ranks_per_node GPUs, which
the global policy does not (bench/eplb.py shows where that matters).

Pure code: lists in, lists out, no I/O. moves.py matches a new plan to the running one and counts the bytes.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

Ranks = list[list[int]]  # per GPU of the group, the logical expert held in each of its slots
POLICIES = ("hierarchical", "global", "best")


@dataclass(frozen=True)
class Cluster:
    """The GPUs of one worker group and its physical expert slots."""

    nodes: int
    ranks_per_node: int
    slots: int  # physical expert slots over all ranks: the logical experts plus the redundant budget
    groups: int = 0  # expert groups kept whole on one node; 0: every expert its own group
    policy: str = "hierarchical"  # one of POLICIES

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1 or self.groups < 0:
            raise ValueError("nodes and ranks per node must be positive, groups >= 0")
        if self.policy not in POLICIES:
            raise ValueError(f"placement policy must be one of {list(POLICIES)}, got {self.policy!r}")
        if self.slots % self.ranks:
            raise ValueError(f"{self.slots} expert slots do not divide among {self.ranks} GPUs")

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def slots_per_rank(self) -> int:
        return self.slots // self.ranks

    def check(self, experts: int) -> None:
        if self.slots < experts:
            raise ValueError(f"{self.slots} slots cannot hold {experts} experts once each")
        if self.groups and experts % self.groups:
            raise ValueError(f"{experts} experts do not split into {self.groups} groups")

    def layouts(self, experts: int) -> list[Layout]:
        """The (nodes, ranks per node, groups) to plan with: one node when the groups do not divide among them
        or the policy is global; both when it is "best"."""
        groups = self.groups or experts
        flat = Layout(1, self.ranks, groups)
        if groups % self.nodes or self.policy == "global":
            return [flat]
        nested = Layout(self.nodes, self.ranks_per_node, groups)
        return [nested, flat] if self.policy == "best" and self.nodes > 1 else [nested]


class Layout(NamedTuple):
    nodes: int
    ranks_per_node: int
    groups: int


def pack(weights: Sequence[float], bins: int) -> list[list[int]]:
    """Item indices per bin, len(weights) / bins each, heaviest first into the lightest bin with room."""
    per, left = divmod(len(weights), bins)
    assert left == 0, f"{len(weights)} items do not fill {bins} bins evenly"
    content: list[list[int]] = [[] for _ in range(bins)]
    open_bins = [(0.0, b) for b in range(bins)]  # (load, bin) of the bins with room: a heap
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, b = heapq.heappop(open_bins)
        content[b].append(item)
        if len(content[b]) < per:
            heapq.heappush(open_bins, (load + weights[item], b))
    return content


def replicate(weights: Sequence[float], slots: int) -> list[int]:
    """Replicas per expert, `slots` in all: one each, then each spare one to the most loaded per replica."""
    assert slots >= len(weights)
    counts = [1] * len(weights)
    heap = [(-w, e) for e, w in enumerate(weights)]  # (-load per replica, expert)
    heapq.heapify(heap)
    for _ in range(slots - len(weights)):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-weights[e] / counts[e], e))
    return counts


def plan_layer(loads: Sequence[float], cluster: Cluster, layout: Layout | None = None) -> Ranks:
    """One layer's placement: the logical expert of every slot of every GPU (GPUs in node order)."""
    E = len(loads)
    cluster.check(E)
    nodes, ranks_per_node, groups = layout or cluster.layouts(E)[0]
    size = E // groups
    group_loads = [sum(loads[g * size : (g + 1) * size]) for g in range(groups)]
    ranks: Ranks = []
    for node_groups in pack(group_loads, nodes):
        experts = [g * size + j for g in sorted(node_groups) for j in range(size)]
        counts = replicate([loads[e] for e in experts], cluster.slots // nodes)
        replicas = [e for e, c in zip(experts, counts) for _ in range(c)]
        share = [loads[e] / c for e, c in zip(experts, counts) for _ in range(c)]
        ranks += [sorted(replicas[i] for i in gpu) for gpu in pack(share, ranks_per_node)]
    return ranks


def rank_loads(ranks: Ranks, loads: Sequence[float]) -> list[float]:
    """Each GPU's load under `loads`, an expert's tokens split evenly over its replicas."""
    replicas = Counter(e for rank in ranks for e in rank)
    return [sum(loads[e] / replicas[e] for e in rank) for rank in ranks]


def imbalance(per_gpu: Sequence[float]) -> float:
    """max / mean of the GPUs' loads; 1.0 (balanced) when there is no load at all."""
    mean = sum(per_gpu) / len(per_gpu)
    return max(per_gpu) / mean if mean > 0 else 1.0


def initial(experts: int, cluster: Cluster) -> Ranks:
    """The placement a worker starts with: expert e in slot e, GPUs in order; the redundant slots hold second
    copies of experts 0, 1, ..."""
    cluster.check(experts)
    flat = [s % experts for s in range(cluster.slots)]
    per = cluster.slots_per_rank
    return [flat[r * per : (r + 1) * per] for r in range(cluster.ranks)]
