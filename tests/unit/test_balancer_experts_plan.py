"""The expert-placement planner (services/balancer/experts/): balance on skewed loads within bounds computed from
the inputs, every expert placed, replicas within the budget, bytes moved counted and bounded, nothing moved when
the running plan is already the one the loads call for."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.balancer.experts.moves import align, match, replan
from services.balancer.experts.plan import Cluster, imbalance, initial, pack, plan_layer, rank_loads, replicate

EXPERTS = 64
EXPERT_BYTES = 1000


def zipf(experts: int, seed: int, exponent: float = 1.0) -> list[float]:
    """Zipf-like loads (token-expert pairs), the hot experts at random positions."""
    rng = random.Random(seed)
    loads = [1e4 / (rank + 1) ** exponent for rank in range(experts)]
    rng.shuffle(loads)
    return loads


def best_share(loads: list[float], slots: int) -> float:
    """The smallest possible largest per-replica load with `slots` replicas: the least m with
    sum(ceil(load / m)) <= slots, searched among the values load / c it can take."""
    candidates = sorted({w / c for w in loads for c in range(1, slots + 1)})
    return next(m for m in candidates if m > 0 and sum(max(1, math.ceil(w / m - 1e-9)) for w in loads) <= slots)


def test_pack_fills_every_bin_evenly_and_bounds_the_heaviest() -> None:
    rng = random.Random(1)
    for bins, per in [(1, 5), (4, 3), (8, 8), (7, 2)]:
        weights = [rng.paretovariate(1.2) for _ in range(bins * per)]
        content = pack(weights, bins)
        assert sorted(i for b in content for i in b) == list(range(bins * per))
        assert all(len(b) == per for b in content)
        loads = [sum(weights[i] for i in b) for b in content]
        assert max(loads) <= sum(weights) / bins + max(weights)


def test_replication_minimises_the_largest_share() -> None:
    loads = zipf(16, seed=2)
    for slots in (16, 20, 32):
        counts = replicate(loads, slots)
        assert sum(counts) == slots and min(counts) >= 1
        assert max(w / c for w, c in zip(loads, counts)) == pytest.approx(best_share(loads, slots))


@pytest.mark.parametrize("gpus", [8, 16, 32])
def test_skewed_loads_are_balanced_within_the_bound_of_their_largest_share(gpus: int) -> None:
    """Global policy: each GPU within one (optimal) replica share of the mean, far below the initial spread."""
    loads = zipf(EXPERTS, seed=gpus)
    cluster = Cluster(nodes=1, ranks_per_node=gpus, slots=EXPERTS + gpus)
    ranks = plan_layer(loads, cluster)
    per_gpu = rank_loads(ranks, loads)
    mean = sum(loads) / gpus
    assert max(per_gpu) <= mean + best_share(loads, cluster.slots) + 1e-6
    assert imbalance(per_gpu) < imbalance(rank_loads(initial(EXPERTS, cluster), loads))


def test_hierarchical_keeps_each_group_on_one_node_and_balances_nodes() -> None:
    loads = zipf(EXPERTS, seed=5, exponent=0.6)
    cluster = Cluster(nodes=4, ranks_per_node=4, slots=EXPERTS + 16, groups=16)
    ranks = plan_layer(loads, cluster)
    node_of: dict[int, set[int]] = {}
    for r, rank in enumerate(ranks):
        for e in rank:
            node_of.setdefault(e, set()).add(r // 4)
    size = EXPERTS // 16
    for g in range(16):  # every replica of a group's experts on the group's one node
        assert len(set().union(*(node_of[e] for e in range(g * size, (g + 1) * size)))) == 1
    node_loads = [sum(rank_loads(ranks, loads)[n * 4 : (n + 1) * 4]) for n in range(4)]
    heaviest_group = max(sum(loads[g * size : (g + 1) * size]) for g in range(16))
    assert max(node_loads) <= sum(loads) / 4 + heaviest_group + 1e-6


@pytest.mark.parametrize("policy", ["hierarchical", "global", "best"])
def test_every_expert_placed_and_the_replicas_within_the_budget(policy: str) -> None:
    cluster = Cluster(nodes=2, ranks_per_node=4, slots=EXPERTS + 8, policy=policy)
    plan = replan([zipf(EXPERTS, seed=s) for s in range(3)], cluster, None, EXPERT_BYTES)
    for ranks in plan.placement:
        assert len(ranks) == cluster.ranks and all(len(r) == cluster.slots_per_rank for r in ranks)
        held = Counter(e for r in ranks for e in r)
        assert set(held) == set(range(EXPERTS))  # each logical expert at least once, none other
        assert sum(held.values()) == cluster.slots  # EXPERTS + 8 redundant copies, no more
    assert plan.after < plan.before


def test_the_best_policy_is_never_worse_than_either() -> None:
    loads = [zipf(EXPERTS, seed=s, exponent=1.2) for s in range(4)]
    after = {p: replan(loads, Cluster(4, 2, EXPERTS + 8, policy=p), None, EXPERT_BYTES).layers
             for p in ("hierarchical", "global", "best")}
    for i in range(4):
        assert after["best"][i].after == min(after["hierarchical"][i].after, after["global"][i].after)


def test_an_optimal_plan_moves_nothing() -> None:
    """Re-planned on the same loads until no candidate beats it (each step strictly lowers some layer's imbalance,
    so it ends), the plan is re-planned to itself: nothing moves. A fresh plan made for those loads is matched
    to it GPU for GPU, slot for slot."""
    cluster = Cluster(nodes=2, ranks_per_node=4, slots=EXPERTS + 8)
    loads = [zipf(EXPERTS, seed=s) for s in range(3)]
    plan = replan(loads, cluster, None, EXPERT_BYTES)
    for _ in range(20):
        again = replan(loads, cluster, plan.placement, EXPERT_BYTES)
        if not again.changed:
            break
        assert again.after < plan.after
        plan = again
    assert again.moved_bytes == 0 and again.changed == 0 and again.placement == plan.placement
    fresh = replan(loads, cluster, None, EXPERT_BYTES).placement
    for layer, ranks in zip(loads, fresh):
        assert align(plan_layer(layer, cluster), ranks, cluster.ranks_per_node) == ranks


def moved_copies(old: list[list[int]], new: list[list[int]]) -> int:
    """Expert copies each GPU gains, counted expert by expert."""
    total = 0
    for o, n in zip(old, new):
        for e in set(n):
            total += max(0, n.count(e) - o.count(e))
    return total


def test_bytes_moved_equal_the_copies_gpus_gain_and_stay_within_the_slots() -> None:
    cluster = Cluster(nodes=2, ranks_per_node=4, slots=EXPERTS + 8)
    before = [zipf(EXPERTS, seed=s) for s in range(3)]
    first = replan(before, cluster, None, EXPERT_BYTES)
    drifted = [[w * (3.0 if e % 7 == 0 else 1.0) for e, w in enumerate(layer)] for layer in before]
    second = replan(drifted, cluster, first.placement, EXPERT_BYTES)
    copies = sum(moved_copies(o, n) for o, n in zip(first.placement, second.placement))
    assert second.moved_bytes == copies * EXPERT_BYTES > 0
    assert second.moved_bytes <= len(before) * cluster.slots * EXPERT_BYTES
    # matched to the running GPUs: it moves less than the same plan laid out unmatched
    unmatched = sum(moved_copies(o, plan_layer(w, cluster)) for o, w in zip(first.placement, drifted))
    assert copies <= unmatched


def test_a_small_gain_keeps_the_running_placement() -> None:
    cluster = Cluster(nodes=1, ranks_per_node=8, slots=EXPERTS + 8)
    loads = [zipf(EXPERTS, seed=s) for s in range(3)]
    first = replan(loads, cluster, None, EXPERT_BYTES)
    nudged = [[w * (1.02 if e % 2 else 0.98) for e, w in enumerate(layer)] for layer in loads]
    free = replan(nudged, cluster, first.placement, EXPERT_BYTES)
    assert free.moved_bytes > 0  # with no threshold, any gain is taken
    kept = replan(nudged, cluster, first.placement, EXPERT_BYTES,
                  min_gain=max(layer.before - layer.after for layer in free.layers))
    assert kept.moved_bytes == 0 and kept.placement == first.placement
    assert all(layer.after == layer.before for layer in kept.layers)


def test_no_load_is_balanced_and_moves_nothing() -> None:
    cluster = Cluster(nodes=1, ranks_per_node=4, slots=EXPERTS + 4)
    plan = replan([[0.0] * EXPERTS], cluster, [initial(EXPERTS, cluster)], EXPERT_BYTES)
    assert plan.before == plan.after == 1.0 and plan.moved_bytes == 0


def test_match_gives_each_running_bin_the_new_bin_sharing_most() -> None:
    old = [Counter([1, 2]), Counter([3, 4]), Counter([5, 6])]
    new = [Counter([3, 9]), Counter([7, 8]), Counter([1, 2])]
    assert match(new, old) == [2, 0, 1]


@pytest.mark.parametrize("kwargs, error", [
    (dict(nodes=1, ranks_per_node=3, slots=64), "do not divide"),
    (dict(nodes=0, ranks_per_node=3, slots=63), "positive"),
    (dict(nodes=1, ranks_per_node=4, slots=64, policy="magic"), "policy"),
])
def test_bad_clusters_are_refused(kwargs: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Cluster(**kwargs)


def test_too_few_slots_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        plan_layer([1.0] * EXPERTS, Cluster(nodes=1, ranks_per_node=4, slots=32))


def test_adjusting_the_running_placement_keeps_the_budget_and_moves_little() -> None:
    """After a drift, the running placement adjusted (incremental.py): replica counts as the loads call for,
    every expert still placed, better balanced than before it, and fewer copies moved than a fresh plan's."""
    from services.balancer.experts.incremental import adjust

    cluster = Cluster(nodes=1, ranks_per_node=8, slots=EXPERTS + 8)
    loads = zipf(EXPERTS, seed=11)
    running = replan([loads], cluster, None, EXPERT_BYTES).placement[0]
    drifted = [w * (2.0 if e % 9 == 0 else 1.0) for e, w in enumerate(loads)]
    adjusted = adjust(running, drifted, max_swaps=32)
    held = Counter(e for r in adjusted for e in r)
    assert [held[e] for e in range(EXPERTS)] == replicate(drifted, cluster.slots)
    assert all(len(r) == cluster.slots_per_rank for r in adjusted)
    assert imbalance(rank_loads(adjusted, drifted)) < imbalance(rank_loads(running, drifted))
    fresh = align(plan_layer(drifted, cluster), running, cluster.ranks_per_node)
    assert moved_copies(running, adjusted) < moved_copies(running, fresh)


def test_a_replan_prefers_the_cheaper_of_two_near_equal_placements() -> None:
    cluster = Cluster(nodes=1, ranks_per_node=8, slots=EXPERTS + 8)
    loads = [zipf(EXPERTS, seed=s) for s in range(3)]
    running = replan(loads, cluster, None, EXPERT_BYTES).placement
    drifted = [[w * (2.0 if e % 9 == 0 else 1.0) for e, w in enumerate(layer)] for layer in loads]
    exact = replan(drifted, cluster, running, EXPERT_BYTES)  # min_gain 0: the best balance, whatever it moves
    loose = replan(drifted, cluster, running, EXPERT_BYTES, min_gain=0.05)
    assert loose.moved_bytes <= exact.moved_bytes
    for a, b in zip(loose.layers, exact.layers):
        assert a.after <= b.after + 0.05 or a.moved == 0


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_cluster_and_loads_keep_the_invariants(data: st.DataObject) -> None:
    """Whatever the shape and the loads: every expert placed, the slots exactly filled, the bytes what the GPUs
    gain, and a re-plan never worse than the placement it replaces."""
    nodes = data.draw(st.integers(1, 3))
    per_node = data.draw(st.integers(1, 4))
    experts = data.draw(st.sampled_from([8, 12, 24]))
    spare = data.draw(st.integers(0, 2)) * nodes * per_node
    slots = -(-experts // (nodes * per_node)) * nodes * per_node + spare
    policy = data.draw(st.sampled_from(["hierarchical", "global", "best"]))
    cluster = Cluster(nodes, per_node, slots, groups=data.draw(st.sampled_from([0, 4])), policy=policy)
    loads = [data.draw(st.lists(st.integers(0, 1000).map(float), min_size=experts, max_size=experts))
             for _ in range(2)]
    first = replan(loads, cluster, None, EXPERT_BYTES)
    drifted = [list(reversed(layer)) for layer in loads]
    second = replan(drifted, cluster, first.placement, EXPERT_BYTES, min_gain=data.draw(st.sampled_from([0, 0.05])))
    for plan, old in ((first, [initial(experts, cluster)] * 2), (second, first.placement)):
        for layer, ranks in zip(plan.layers, plan.placement):
            assert set(e for r in ranks for e in r) == set(range(experts))
            assert [len(r) for r in ranks] == [cluster.slots_per_rank] * cluster.ranks
            assert layer.after <= layer.before
        assert plan.moved_bytes == sum(moved_copies(o, n) for o, n in zip(old, plan.placement)) * EXPERT_BYTES
