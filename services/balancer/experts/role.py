"""The `experts` balancer role: from the routing counts workers report, each worker group's expert placement,
re-planned on a period or sooner when the running placement's imbalance passes a threshold.

    experts.load --> SlidingLoads (per group, the last window_s seconds of counts)
    tick(now), each group:  due = no plan yet | period over | (min interval over and imbalance > threshold)
                            due --> moves.replan(loads, the group's cluster, the placement it runs) --> ExpertPlan

The placement a group runs is the plan whose version its workers report (ExpertLoad.plan_version): 0 is the
initial one (plan.initial), and a balancer that restarted, or plans its workers never applied (single-GPU
workers only log them), fall back to it, so a re-plan's bytes are always counted from what the GPUs hold.
A group's first plan is always published; later ones only when some layer changes. Pure: no I/O, `now` given.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from services.balancer.experts.loads import BadLoad, SlidingLoads
from services.balancer.experts.moves import replan
from services.balancer.experts.plan import Cluster, Ranks, imbalance, initial, rank_loads
from services.balancer.experts.settings import ExpertsSettings
from shared.schemas.experts import ExpertLoad, ExpertPlan

EXPERTS = "experts"  # the role's name in --roles
KEPT_PLANS = 4  # per group: the versions its workers may still be reporting


@dataclass(frozen=True)
class Published:
    version: int
    placement: list[Ranks]
    planned_at: float


class ExpertsRole:
    name = EXPERTS

    def __init__(self, settings: ExpertsSettings = ExpertsSettings()) -> None:
        self.settings = settings
        self.loads = SlidingLoads(settings.experts_window_s)
        self.plans: dict[str, list[Published]] = {}  # group -> its latest plans, oldest first
        self.stats: Counter[str] = Counter()

    def observe(self, load: ExpertLoad, now: float) -> None:
        """One worker's window of counts; raises BadLoad for a report that does not fit its own shape."""
        try:
            self.cluster(load)
        except ValueError as exc:
            raise BadLoad(f"{load.worker_id}: {exc}") from None
        self.loads.observe(load, now)
        self.stats["loads"] += 1

    def cluster(self, load: ExpertLoad) -> Cluster:
        cluster = Cluster(load.nodes, load.ranks_per_node, load.experts + load.redundant_slots,
                          policy=self.settings.experts_policy)
        cluster.check(load.experts)
        return cluster

    def running(self, group: str) -> list[Ranks]:
        """The placement the group's workers say they run."""
        last = self.loads.groups[group].last
        for plan in self.plans.get(group, []):
            if plan.version == last.plan_version:
                return plan.placement
        return [initial(last.experts, self.cluster(last))] * last.layers

    def imbalance(self, group: str) -> float:
        """Mean over layers of max / mean GPU load of the running placement under the window's loads."""
        total, placement = self.loads.groups[group].total(), self.running(group)
        return sum(imbalance(rank_loads(ranks, row.tolist())) for ranks, row in zip(placement, total)) / len(total)

    def due(self, group: str, now: float) -> bool:
        plans = self.plans.get(group)
        if not plans:
            return True
        since = now - plans[-1].planned_at
        if since >= self.settings.experts_period_s:
            return True
        return since >= self.settings.experts_min_interval_s and self.imbalance(group) > self.settings.experts_imbalance

    def tick(self, now: float) -> list[ExpertPlan]:
        """The plans due now, one per group at most."""
        self.loads.expire(now)
        out = []
        for group in sorted(self.loads.groups):
            if self.due(group, now) and (plan := self.replan(group, now)) is not None:
                out.append(plan)
        return out

    def replan(self, group: str, now: float) -> ExpertPlan | None:
        loads = self.loads.groups[group]
        total = loads.total()
        if int(total.sum()) < self.settings.experts_min_tokens:
            return None  # nothing routed in the window: nothing to learn from
        last, plans = loads.last, self.plans.setdefault(group, [])
        cluster = self.cluster(last)
        result = replan(total.tolist(), cluster, self.running(group), last.expert_bytes, self.settings.experts_min_gain)
        self.stats["replans"] += 1
        version = plans[-1].version + 1 if plans else 1
        if plans and not result.changed:
            # checked, and nothing is worth moving: the period starts again, the running plan stands
            plans[-1] = Published(plans[-1].version, plans[-1].placement, now)
            self.stats["replans_kept"] += 1
            return None
        plans.append(Published(version, result.placement, now))
        del plans[:-KEPT_PLANS]
        self.stats["plans"] += 1
        return ExpertPlan(
            group=group, model=last.model, version=version, layers=last.layers, experts=last.experts,
            ranks=cluster.ranks, slots_per_rank=cluster.slots_per_rank,
            physical=[[e for rank in ranks for e in rank] for ranks in result.placement],
            moved_bytes=result.moved_bytes, layers_changed=result.changed,
            imbalance_before=result.before, imbalance_after=result.after, planned_at=now,
        )
