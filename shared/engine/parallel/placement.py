"""Which logical expert every physical slot of a worker's ranks holds, layer by layer (ExpertPlan's layout):

    physical[layer][slot] = logical expert        slot s lives on rank s // slots_per_rank, as its local slot
                                                  s % slots_per_rank

    2 ranks, 8 experts, 1 redundant slot a rank (hot experts 0 and 5 replicated):
        rank 0: slots 0-4 -> [0 1 2 3 5]          rank 1: slots 5-9 -> [4 5 6 7 0]

The default placement is the even contiguous split with no replicas (expert e in slot e, the initial placement
ExpertLoad's plan_version 0 names). Pure: no collectives, no devices beyond building the routing tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.schemas.experts import ExpertPlan


@dataclass(frozen=True)
class Transfer:
    """One expert's weights a rank lacks under the new placement, and the rank that sends them."""

    layer: int
    slot: int  # the new physical slot (on rank dst)
    expert: int
    src: int  # the lowest rank holding `expert` under the old placement
    dst: int


@dataclass(frozen=True)
class Placement:
    experts: int
    ranks: int
    slots_per_rank: int
    physical: tuple[tuple[int, ...], ...]  # (layers, ranks * slots_per_rank)
    version: int = 0

    def __post_init__(self) -> None:
        slots = self.ranks * self.slots_per_rank
        for layer, row in enumerate(self.physical):
            if len(row) != slots:
                raise ValueError(f"layer {layer}: {len(row)} slots, {self.ranks} ranks x {self.slots_per_rank}")
            if not all(0 <= e < self.experts for e in row) or len(set(row)) != self.experts:
                raise ValueError(f"layer {layer}: slots must hold every one of {self.experts} experts")

    @classmethod
    def even(cls, layers: int, experts: int, ranks: int) -> Placement:
        if experts % ranks:
            raise ValueError(f"{experts} experts do not split evenly over {ranks} ranks")
        return cls(experts, ranks, experts // ranks, tuple(tuple(range(experts)) for _ in range(layers)))

    @classmethod
    def from_plan(cls, plan: ExpertPlan) -> Placement:
        """A balancer's plan; ValueError when it does not describe a placement of every expert."""
        if len(plan.physical) != plan.layers:
            raise ValueError(f"plan {plan.version}: {len(plan.physical)} layers of slots, {plan.layers} declared")
        return cls(plan.experts, plan.ranks, plan.slots_per_rank, tuple(tuple(row) for row in plan.physical),
                   plan.version)

    @property
    def layers(self) -> int:
        return len(self.physical)

    def local(self, layer: int, rank: int) -> list[int]:
        """The logical experts in rank's local slots, in slot order."""
        at = rank * self.slots_per_rank
        return list(self.physical[layer][at : at + self.slots_per_rank])

    def slots_of(self, layer: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.experts)]
        for slot, expert in enumerate(self.physical[layer]):
            out[expert].append(slot)
        return out

    def table(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """-> slots (E, R) int64, expert e's physical slots padded with its first to R = the most replicas,
        and replicas (E,) int64, how many there are: a pair (row t, expert e) goes to slots[e, t % replicas[e]]."""
        of = self.slots_of(layer)
        width = max(len(s) for s in of)
        slots = torch.tensor([s + [s[0]] * (width - len(s)) for s in of], dtype=torch.int64, device=device)
        return slots, torch.tensor([len(s) for s in of], dtype=torch.int64, device=device)

    def transfers(self, new: Placement) -> list[Transfer]:
        """What `new` needs moved, in one order every rank computes alike: each new slot whose rank held none
        of its expert before gets it from the lowest rank that did."""
        if (new.experts, new.ranks, new.layers) != (self.experts, self.ranks, self.layers):
            raise ValueError("a placement of another shape (experts, ranks, layers)")
        out = []
        for layer in range(self.layers):
            held = [set(self.local(layer, r)) for r in range(self.ranks)]
            for slot, expert in enumerate(new.physical[layer]):
                dst = slot // new.slots_per_rank
                if expert not in held[dst]:
                    src = min(r for r in range(self.ranks) if expert in held[r])
                    out.append(Transfer(layer, slot, expert, src, dst))
        return out
