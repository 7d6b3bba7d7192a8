"""Data-parallel attention under one scheduler: rank 0 decides every step, every rank runs its own sequences.

    rank 0 (the bus-facing worker)          rank 1..W-1 (followers)
      plan = scheduler's step                 plan = broadcast_bytes()      <- StepPlan, msgpack
      broadcast_bytes(plan)                   apply plan.placement (if any), drop plan.finished
      run my spans / idle()                   run my spans / idle()         <- every MoE layer exchanges here
      tokens = all_reduce(sum)                tokens = all_reduce(sum)      <- each span's token, from its rank

Why rank 0 schedules rather than ranks running lock-step on a shared counter: only rank 0 talks to the bus, so
the group registers as one prefill or decode worker with one work queue, one admission and one block layout per
rank; followers decide nothing and so cannot diverge (a lock-step design would need every rank to see the same
bus messages in the same order). The price is one small broadcast per step, which the MoE exchanges dwarf.

The plan is intra-worker, not a bus message: it lives here rather than in shared/schemas/, but it travels in the
codec's msgpack all the same (no pickle). Sampling here is greedy (argmax on the span's rank, the ids summed
across ranks): the engine's sampler on rank 0 would need the logits gathered or the sampler's seeds planned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.codec import decode, encode
from shared.engine.attention import AttentionMetadata, SeqSpan
from shared.engine.parallel.ep_moe import ExpertParallel
from shared.engine.parallel.group import Group
from shared.engine.parallel.placement import Placement


@dataclass(frozen=True)
class SpanPlan:
    request_id: str
    rank: int  # the rank whose attention (and KV cache) holds this sequence
    start: int  # the chunk's first position; 0 admits the request on its rank
    tokens: list[int]
    blocks: list[int]  # the sequence's block table in its rank's cache, at least ceil(context / block_tokens)


@dataclass(frozen=True)
class PlacementPlan:
    version: int
    slots_per_rank: int
    physical: list[list[int]]  # ExpertPlan.physical


@dataclass(frozen=True)
class StepPlan:
    spans: list[SpanPlan]
    finished: list[str] = field(default_factory=list)  # requests whose state their rank drops before the step
    placement: PlacementPlan | None = None  # switched to before the step, on every rank at once
    stop: bool = False  # the followers leave their loop


class RankRunner:
    """One rank's part of every step: its model (every weight but the routed experts of other slots), its cache."""

    def __init__(self, model, kv, group: Group) -> None:
        assert isinstance(model.expert_parallel, ExpertParallel)
        self.model, self.kv, self.group = model, kv, group
        self.ep: ExpertParallel = model.expert_parallel

    def share(self, plan: StepPlan | None) -> StepPlan:
        """Rank 0 passes its plan, the others None: every rank returns rank 0's."""
        return decode(StepPlan, self.group.broadcast_bytes(encode(plan) if self.group.rank == 0 else None))

    def step(self, plan: StepPlan) -> list[int]:
        """-> the greedy next token of every span of the plan (all ranks' spans, in plan order)."""
        if plan.placement is not None:
            p = plan.placement
            self.ep.apply(Placement(self.ep.placement.experts, self.group.world, p.slots_per_rank,
                                    tuple(tuple(row) for row in p.physical), p.version))
        mine = [(n, span) for n, span in enumerate(plan.spans) if span.rank == self.group.rank]
        assert not {span.request_id for _, span in mine} & set(plan.finished), "a request finished and scheduled"
        for rid in plan.finished:
            self.kv.drop_state(rid)  # a no-op on the ranks that never held it
        tokens = torch.zeros(len(plan.spans), dtype=torch.int64, device=self.group.device)
        if mine:
            tokens[[n for n, _ in mine]] = self._forward([span for _, span in mine])
        else:
            self.ep.idle(self.model.spec)
        return self.group.all_reduce_sum(tokens).tolist()

    def follow(self) -> None:
        """A follower's loop: every step rank 0 plans, until it says stop."""
        while not (plan := self.share(None)).stop:
            self.step(plan)

    def _forward(self, spans: list[SpanPlan]) -> torch.Tensor:
        bt, dev = self.model.block_tokens, self.group.device
        ids: list[int] = []
        pos: list[int] = []
        meta_spans = []
        for span in spans:
            if span.start == 0:
                self.kv.begin(span.request_id, 0)
            end = span.start + len(span.tokens)
            table = torch.tensor(span.blocks[: -(-end // bt)], dtype=torch.int64, device=dev)
            meta_spans.append(SeqSpan(len(ids), len(span.tokens), end, table, span.request_id))
            ids += span.tokens
            pos += range(span.start, end)
        meta = AttentionMetadata(torch.zeros(len(ids), dtype=torch.int64, device=dev), meta_spans)
        streams = self.model.forward(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta, self.kv)
        last = torch.tensor([s.q_start + s.q_len - 1 for s in meta_spans], device=dev)
        return self.model.logits(streams[last]).argmax(-1)


def generate(runner: RankRunner, prompts: dict[str, list[int]], max_new: int, blocks_per_rank: int,
             placements: dict[int, PlacementPlan] | None = None) -> dict[str, list[int]]:
    """Rank 0's scheduler at its simplest, for tests and benchmarks: requests spread over ranks round-robin,
    each prefilled whole in the first step, then decoded greedily together for max_new - 1 steps;
    placements[n] is switched to before decode step n. Followers run runner.follow() meanwhile."""
    world, bt = runner.group.world, runner.model.block_tokens
    need = {rid: -(-(len(p) + max_new) // bt) for rid, p in prompts.items()}
    rank = {rid: n % world for n, rid in enumerate(prompts)}
    used = [0] * world
    blocks: dict[str, list[int]] = {}
    for rid in prompts:
        blocks[rid] = list(range(used[rank[rid]], used[rank[rid]] + need[rid]))
        used[rank[rid]] += need[rid]
    if max(used) > blocks_per_rank:
        raise ValueError(f"{max(used)} blocks on one rank, {blocks_per_rank} in its cache")
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    spans = [SpanPlan(rid, rank[rid], 0, p, blocks[rid]) for rid, p in prompts.items()]
    for n in range(max_new):
        plan = runner.share(StepPlan(spans, placement=(placements or {}).get(n)))
        for rid, token in zip(out, runner.step(plan)):
            out[rid].append(token)
        spans = [SpanPlan(rid, rank[rid], len(prompts[rid]) + n, [out[rid][-1]], blocks[rid]) for rid in prompts]
    runner.step(runner.share(StepPlan([], finished=list(prompts))))
    runner.share(StepPlan([], stop=True))
    return out
