"""A re-plan that starts from the running placement instead of from nothing, so it moves few expert weights.

A fresh plan (plan.py) re-sorts every expert by load: a small drift reorders the packing and, matched or not,
most GPUs end up with other experts (bench/eplb.py: 80-90 % of the weights per re-plan). This one edits the
running placement of one layer, node by node (`adjust_nodes`: each node's experts stay on it, as the
hierarchical policy wants; with one node, the global policy's freedom):

    1. replica counts: replicate() for the new loads; an expert with copies to spare loses them from the busiest
       GPUs holding it, an expert short of copies gets them, most loaded per replica first, in the freed slots
       of the least loaded GPUs not holding it yet
    2. swaps: while an exchange of one slot between the busiest GPU and one of the SWAP_PARTNERS idlest lowers
       the busier of the two, make the best such exchange (at most `max_swaps`; each moves two expert copies)

moves.replan weighs it against the fresh plan and against keeping the layer as it is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from services.balancer.experts.plan import Ranks, replicate


def adjust_nodes(old: Ranks, loads: Sequence[float], ranks_per_node: int, max_swaps: int) -> Ranks | None:
    """`adjust` within each node of `ranks_per_node` GPUs; None when some expert is held on several nodes (the
    initial placement's redundant copies are: then only a fresh plan will do)."""
    nodes: dict[int, set[int]] = {}
    for g, rank in enumerate(old):
        for e in rank:
            nodes.setdefault(e, set()).add(g // ranks_per_node)
    if len(nodes) < len(loads) or any(len(on) > 1 for on in nodes.values()):
        return None
    out: Ranks = []
    for first in range(0, len(old), ranks_per_node):
        node = old[first : first + ranks_per_node]
        local = sorted({e for rank in node for e in rank})  # the node's experts, renumbered 0..n-1 for adjust
        index = {e: i for i, e in enumerate(local)}
        adjusted = adjust([[index[e] for e in rank] for rank in node], [loads[e] for e in local], max_swaps)
        out += [[local[i] for i in rank] for rank in adjusted]
    return out


def adjust(old: Ranks, loads: Sequence[float], max_swaps: int) -> Ranks:
    ranks = [list(r) for r in old]
    slots = sum(len(r) for r in ranks)
    want = replicate(loads, slots)
    have = Counter(e for r in ranks for e in r)

    def share(e: int) -> float:
        return loads[e] / want[e]

    def gpu_loads() -> list[float]:
        return [sum(share(e) for e in r if e >= 0) for r in ranks]

    for e in sorted(e for e in have if have[e] > want[e]):  # 1a: surplus copies leave the busiest GPUs
        for _ in range(have[e] - want[e]):
            per_gpu = gpu_loads()
            g = max((g for g, r in enumerate(ranks) if e in r), key=lambda g: (per_gpu[g], -g))
            ranks[g][ranks[g].index(e)] = -1  # a free slot
    missing = [e for e in range(len(loads)) for _ in range(want[e] - have.get(e, 0))]
    for e in sorted(missing, key=lambda e: (-share(e), e)):  # 1b: copies short go to the idlest free slots
        per_gpu = gpu_loads()
        free = [g for g, r in enumerate(ranks) if -1 in r]
        g = min(free, key=lambda g: (e in ranks[g], per_gpu[g], g))
        ranks[g][ranks[g].index(-1)] = e
    for _ in range(max_swaps):  # 2: swaps between the busiest and the idlest GPU
        if not swap_once(ranks, [share(e) for e in range(len(loads))]):
            break
    return ranks


SWAP_PARTNERS = 8  # the idlest GPUs a busiest one tries to swap with, per swap (bounds a plan's time)


def swap_once(ranks: Ranks, share: list[float]) -> bool:
    """One swap of a slot of the busiest GPU with one of the idlest GPUs that it can improve on; False when none."""
    per_gpu = [sum(share[e] for e in r) for r in ranks]
    hi = int(np.argmax(per_gpu))
    a = np.array([share[e] for e in ranks[hi]])  # (S,) the busiest GPU's slots
    for lo in sorted(range(len(ranks)), key=lambda g: (per_gpu[g], g))[:SWAP_PARTNERS]:
        if per_gpu[lo] >= per_gpu[hi]:
            return False
        b = np.array([share[e] for e in ranks[lo]])  # (S,)
        peak = np.maximum(per_gpu[hi] - a[:, None] + b[None, :], per_gpu[lo] + a[:, None] - b[None, :])  # (S, S)
        # never a second copy of an expert onto a GPU that holds one (its load would not spread)
        on_lo, on_hi = set(ranks[lo]), set(ranks[hi])
        peak[[e in on_lo for e in ranks[hi]], :] = np.inf
        peak[:, [e in on_hi for e in ranks[lo]]] = np.inf
        i, j = np.unravel_index(int(np.argmin(peak)), peak.shape)
        if peak[i, j] < per_gpu[hi] * (1 - 1e-9):
            ranks[hi][i], ranks[lo][j] = ranks[lo][j], ranks[hi][i]
            return True
    return False
