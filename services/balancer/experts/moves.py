"""A re-plan against the running placement: the new plan's GPUs matched to the running ones so that it moves as
few expert weights as it can, the bytes it moves counted, and layers whose gain is small left as they are.

    match        each running node gets the new node sharing most of its experts, then within it each running
                 GPU the new GPU sharing most (greedy, largest overlap first; plan.py's GPUs are unordered)
    slot order   an expert a GPU keeps stays in the slot it had (only arrivals take the freed slots)
    moved(layer) = sum over GPUs of the expert copies it must load that it does not hold now   x expert_bytes
    keep         a layer whose imbalance no candidate lowers by more than `min_gain` keeps its placement:
                 moving ~13 MB (an FP4 V4-Flash expert) per copy is not worth a small gain
    prefer       of the candidates within `min_gain` of the best imbalance, the one that moves least (the
                 running placement adjusted, incremental.py, usually: a few swaps instead of a reshuffle)

A placement that no candidate beats for the loads is kept as it is (it moves nothing), and a fresh plan made
for loads it was planned from is matched to it GPU for GPU, slot for slot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from services.balancer.experts.incremental import adjust_nodes
from services.balancer.experts.plan import Cluster, Ranks, imbalance, initial, plan_layer, rank_loads


@dataclass(frozen=True)
class LayerPlan:
    ranks: Ranks
    before: float  # imbalance of the running placement under the loads
    after: float  # of the chosen one (== before when the layer is kept)
    moved: int  # expert copies loaded onto GPUs that did not hold them


@dataclass(frozen=True)
class Replan:
    layers: list[LayerPlan]
    moved_bytes: int

    @property
    def placement(self) -> list[Ranks]:
        return [layer.ranks for layer in self.layers]

    @property
    def before(self) -> float:
        """Mean over layers of the running placement's imbalance."""
        return sum(layer.before for layer in self.layers) / len(self.layers)

    @property
    def after(self) -> float:
        return sum(layer.after for layer in self.layers) / len(self.layers)

    @property
    def changed(self) -> int:
        """Layers whose placement changes."""
        return sum(1 for layer in self.layers if layer.moved)


def match(new: Sequence[Counter[int]], old: Sequence[Counter[int]]) -> list[int]:
    """For each old bin, the index of the new bin it gets: largest overlaps first (ties: the lower indices), then
    the bins that share nothing, in order. Only pairs sharing an expert are scored (an index by expert), so 64
    GPUs cost thousands of steps, not 64 x 64 multiset intersections."""
    holders: dict[int, list[tuple[int, int]]] = {}  # expert -> (old bin, copies held there)
    for i, b in enumerate(old):
        for e, n in b.items():
            holders.setdefault(e, []).append((i, n))
    shared: Counter[tuple[int, int]] = Counter()
    for j, a in enumerate(new):
        for e, n in a.items():
            for i, m in holders.get(e, ()):
                shared[i, j] += min(n, m)
    out, taken = [-1] * len(old), set()
    for (i, j), _ in sorted(shared.items(), key=lambda p: (-p[1], p[0])):
        if out[i] < 0 and j not in taken:
            out[i] = j
            taken.add(j)
    rest = iter(j for j in range(len(new)) if j not in taken)
    return [j if j >= 0 else next(rest) for j in out]


def keep_slots(new: list[int], old: list[int]) -> list[int]:
    """`new`'s experts in slot order: those `old` holds stay in their slots, arrivals fill the rest in order."""
    kept = Counter(new) & Counter(old)
    arrivals = iter(sorted((Counter(new) - kept).elements()))
    out = []
    for e in old:
        if kept[e]:
            kept[e] -= 1
            out.append(e)
        else:
            out.append(next(arrivals))
    return out


def align(new: Ranks, old: Ranks, ranks_per_node: int) -> Ranks:
    """`new`'s GPUs reordered, whole nodes first and then GPUs within them, to share most with `old`'s GPU of
    the same index, and each GPU's slots ordered as `old`'s."""
    nodes = len(old) // ranks_per_node

    def node(ranks: Ranks, n: int) -> Ranks:
        return ranks[n * ranks_per_node : (n + 1) * ranks_per_node]

    def held(ranks: Ranks) -> Counter[int]:
        return Counter(e for rank in ranks for e in rank)

    order = match([held(node(new, n)) for n in range(nodes)], [held(node(old, n)) for n in range(nodes)])
    out: Ranks = []
    for o, n in enumerate(order):
        new_gpus, old_gpus = node(new, n), node(old, o)
        gpus = match([Counter(g) for g in new_gpus], [Counter(g) for g in old_gpus])
        out += [keep_slots(new_gpus[j], old_gpus[i]) for i, j in enumerate(gpus)]
    return out


def moved(old: Ranks, new: Ranks) -> int:
    """Expert copies the GPUs must load to go from `old` to `new` (GPU i to GPU i)."""
    return sum(sum((Counter(n) - Counter(o)).values()) for o, n in zip(old, new))


def replan(loads: Sequence[Sequence[float]], cluster: Cluster, current: list[Ranks] | None, expert_bytes: int,
           min_gain: float = 0.0) -> Replan:
    """loads (layers, experts) -> the new placement of every layer against `current` (None: the initial one).

    Per layer the candidates are the running placement, a fresh plan per layout (matched to the running GPUs)
    and the running placement adjusted within each of the layout's nodes (incremental.py). The
    choice is the one that moves least among those within `min_gain` of the best imbalance; the running
    placement stays unless some candidate beats it by more than `min_gain`."""
    experts = len(loads[0])
    layouts = cluster.layouts(experts)
    start = initial(experts, cluster)
    layers = []
    for i, layer_loads in enumerate(loads):
        old = current[i] if current is not None else start
        before = imbalance(rank_loads(old, layer_loads))
        candidates = [align(plan_layer(layer_loads, cluster, layout), old, layout.ranks_per_node) for layout in layouts]
        for layout in layouts:
            rpn = layout.ranks_per_node
            if (adjusted := adjust_nodes(old, layer_loads, rpn, max_swaps=4 * rpn)) is not None:
                candidates.append(adjusted)
        scored = [(imbalance(rank_loads(c, layer_loads)), moved(old, c), c) for c in candidates]
        best = min(after for after, _, _ in scored)
        if before - best <= min_gain:  # no gain worth a byte (an equal plan, ties, or a small one)
            layers.append(LayerPlan(old, before, before, 0))
            continue
        after, copies, ranks = min((c for c in scored if c[0] <= best + min_gain), key=lambda c: (c[1], c[0]))
        layers.append(LayerPlan(ranks, before, after, copies))
    return Replan(layers, sum(layer.moved for layer in layers) * expert_bytes)
