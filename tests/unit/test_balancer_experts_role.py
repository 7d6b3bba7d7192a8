"""The experts balancer role, without a broker: sliding windows per group, when it re-plans, what it publishes, and
the placement it counts moves from (the one the group's workers report running)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from services.balancer.config import BalancerConfig
from services.balancer.experts.loads import BadLoad
from services.balancer.experts.plan import Cluster, initial
from services.balancer.experts.role import ExpertsRole
from services.balancer.experts.settings import ExpertsSettings
from shared import codec
from shared.schemas.experts import ExpertLoad, ExpertPlan

LAYERS, EXPERTS = 3, 16
SETTINGS = ExpertsSettings(experts_window_s=60.0, experts_period_s=100.0, experts_imbalance=1.5,
                           experts_min_interval_s=10.0, experts_min_gain=0.0)


def counts(seed: int, hot: int = 0) -> list[int]:
    """Zipf-like per layer; `hot` makes expert 3 of every layer that many times hotter."""
    rng = random.Random(seed)
    out = []
    for _ in range(LAYERS):
        row = [int(1000 / (r + 1)) for r in range(EXPERTS)]
        rng.shuffle(row)
        out += [w * (hot or 1) if e == 3 else w for e, w in enumerate(row)]
    return out


def load(c: list[int], group: str = "g", version: int = 0, **shape) -> ExpertLoad:
    shape = {"nodes": 2, "ranks_per_node": 2, "redundant_slots": 4, **shape}
    return ExpertLoad(worker_id="w", role="decode", model="m", group=group, layers=LAYERS, experts=EXPERTS,
                      counts=c, window_s=5.0, sent_at=0.0, expert_bytes=100, plan_version=version, **shape)


def test_the_first_plan_comes_at_once_and_covers_every_expert() -> None:
    role = ExpertsRole(SETTINGS)
    role.observe(load(counts(1)), now=0.0)
    (plan,) = role.tick(now=1.0)
    assert (plan.group, plan.version, plan.ranks, plan.slots_per_rank) == ("g", 1, 4, 5)
    for layer in range(LAYERS):
        slots = plan.slots_of(layer)
        assert all(slots[e] for e in range(EXPERTS))  # every logical expert somewhere
        assert sorted(s for e in slots for s in e) == list(range(20))  # every slot holds one
    assert plan.imbalance_after < plan.imbalance_before and plan.moved_bytes > 0
    assert codec.decode(ExpertPlan, codec.encode(plan)) == plan  # a declared wire type


def test_no_plan_before_the_period_unless_the_imbalance_passes_the_threshold() -> None:
    role = ExpertsRole(SETTINGS)
    role.observe(load(counts(1)), now=0.0)
    (first,) = role.tick(now=0.0)
    role.observe(load(counts(1), version=1), now=1.0)  # the group now runs plan 1: balanced
    assert role.tick(now=20.0) == []  # within the period, balanced enough
    role.observe(load(counts(1, hot=40), version=1), now=21.0)  # expert 3 turns hot everywhere
    assert role.imbalance("g") > SETTINGS.experts_imbalance
    assert role.tick(now=5.0 + first.planned_at) == []  # too soon after the last plan, hot or not
    (second,) = role.tick(now=22.0)
    assert second.version == 2 and second.layers_changed > 0


def test_a_replan_that_changes_nothing_is_not_published() -> None:
    role = ExpertsRole(SETTINGS)
    role.observe(load(counts(1)), now=0.0)
    role.tick(now=0.0)
    role.observe(load(counts(1), version=1), now=149.0)  # the same loads, on plan 1
    assert role.tick(now=150.0) == [] and role.stats["replans_kept"] == 1  # the period: checked, kept
    assert role.tick(now=160.0) == [] and role.stats["replans"] == 2  # and the period starts again


def test_moves_are_counted_from_the_placement_the_workers_report() -> None:
    role = ExpertsRole(dataclasses.replace(SETTINGS, experts_window_s=1.0))
    role.observe(load(counts(1)), now=0.0)
    (first,) = role.tick(now=0.0)
    role.observe(load(counts(1), version=0), now=200.0)  # the plan was never applied: still the initial one
    (again,) = role.tick(now=200.0)
    assert again.version == 2 and again.moved_bytes == first.moved_bytes  # from the initial placement again
    cluster = Cluster(2, 2, EXPERTS + 4)
    assert role.running("g") == [initial(EXPERTS, cluster)] * LAYERS


def test_windows_slide_and_an_idle_group_plans_nothing() -> None:
    role = ExpertsRole(SETTINGS)
    role.observe(load([0] * (LAYERS * EXPERTS)), now=0.0)
    assert role.tick(now=1.0) == []  # nothing routed
    role.observe(load(counts(1)), now=2.0)
    assert int(role.loads.groups["g"].total().sum()) == sum(counts(1))
    role.loads.expire(now=63.0)  # past the 60 s window
    assert int(role.loads.groups["g"].total().sum()) == 0


def test_groups_are_planned_apart() -> None:
    role = ExpertsRole(SETTINGS)
    role.observe(load(counts(1), group="a"), now=0.0)
    role.observe(load(counts(2), group="b", nodes=1, ranks_per_node=1, redundant_slots=0), now=0.0)
    plans = {p.group: p for p in role.tick(now=1.0)}
    assert plans["a"].ranks == 4 and plans["b"].ranks == 1
    assert plans["b"].physical == [list(range(EXPERTS))] * LAYERS and plans["b"].moved_bytes == 0  # one GPU


@pytest.mark.parametrize("bad", [
    dict(counts=[1, 2, 3]),  # not layers x experts
    dict(counts=[-1] * (LAYERS * EXPERTS)),
    dict(redundant_slots=3),  # 19 slots over 4 GPUs
])
def test_bad_reports_are_refused(bad: dict) -> None:
    role = ExpertsRole(SETTINGS)
    with pytest.raises(BadLoad):
        role.observe(dataclasses.replace(load(counts(1)), **bad), now=0.0)
    assert not role.loads.groups


def test_the_role_is_chosen_by_name_and_its_settings_validated() -> None:
    assert BalancerConfig(roles=("prefill", "experts")).roles == ("prefill", "experts")
    with pytest.raises(ValueError):
        ExpertsSettings(experts_period_s=0)
