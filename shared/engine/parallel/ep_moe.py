"""Expert-parallel MoE: each rank holds the experts of its physical slots (placement.py); a layer's routed
experts run where their weights are, the router and the shared expert run where the rows are.

One layer, on every rank at once (T rows here, k choices each, P = T k pairs, W ranks):

    route            chosen (T, k), weights (T, k): the V4 router, unchanged (moe.route)
    pick a slot      pair p = (row t, expert e) -> slots[e, t % replicas[e]]: replicas share a hot expert's rows
                     by row index, so where a pair runs never depends on timing (and replicas hold equal weights)
    dispatch         pairs sorted by destination rank (stable); counts exchanged (W ints), then one all-to-all
                     of the pairs' rows (P, D) and one of their local slot ids (P,)
    compute          the received rows (N, D) through their local slots: the torch path's experts() or the
                     fused kernel, with weight 1 (the routing weight stays home)
    combine          the all-to-all back (the same splits reversed), unsorted to pair order, weighted and summed
                     over k in float32 (as the fused kernel sums), plus the shared expert

A rank with no rows still joins both exchanges with zero-size splits (idle()). A pair is sent once per chosen
expert, not once per destination rank (DeepEP dedups rows bound for one rank): simpler, at most k times the
bytes when a row's experts share a rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from shared.engine.kernels import HAVE_TRITON
from shared.engine.models.deepseek_v4.moe import experts, route, shared_expert, tally
from shared.engine.models.deepseek_v4.spec import DeepseekV4Spec
from shared.engine.models.deepseek_v4.weights import Experts, Layer
from shared.engine.parallel.group import Group
from shared.engine.parallel.placement import Placement
from shared.engine.quant import Fp4Weight, Weight

if HAVE_TRITON:
    from shared.engine.kernels.moe import fused_moe


class ExpertParallel:
    def __init__(self, group: Group, placement: Placement, stacks: Sequence[Experts], limit: float,
                 dtype: torch.dtype, triton: bool = False, loaded: Sequence[int] | None = None) -> None:
        """stacks: every layer's stacked routed experts as loaded, `loaded` their logical ids in stack order (a
        rank that loaded only its own: DeepseekV4(held_experts=...)), None = all, in order; the rank keeps the
        ones its slots hold."""
        assert placement.ranks == group.world and len(stacks) == placement.layers
        self.group, self.limit, self.dtype, self.triton = group, limit, dtype, triton  # dtype: the activations'
        self.placement = placement
        at = {e: n for n, e in enumerate(range(placement.experts) if loaded is None else loaded)}
        missing = {e for i in range(placement.layers) for e in placement.local(i, group.rank)} - set(at)
        assert not missing, f"rank {group.rank} did not load experts {sorted(missing)} its slots hold"
        self.local = [_take(ex, [at[e] for e in placement.local(i, group.rank)]) for i, ex in enumerate(stacks)]
        self.tables = [placement.table(i, group.device) for i in range(placement.layers)]
        # called as every forward of the main layers begins: rank 0 of servers.py wakes its followers
        self.announce: Callable[[], None] | None = None

    def attach(self, model) -> None:
        """Route the model's main layers through this: their own stacks are dropped (the MTP draft layer keeps
        its experts whole and local: one layer, run by rank 0's drafter alone)."""
        for i, layer in enumerate(model.layers):
            model.layers[i] = dataclasses.replace(layer, experts=_take(layer.experts, []))
        model.expert_parallel = self
        model.rank_experts = self.local  # reachable from the model: its memory account (memory.py) counts them

    # --- a layer ------------------------------------------------------------------------------------------------

    def moe(self, s: DeepseekV4Spec, i: int, layer: Layer, x: torch.Tensor, input_ids: torch.Tensor,
            counts: torch.Tensor | None = None, real: torch.Tensor | None = None) -> torch.Tensor:
        """moe.moe's contract (x (T, D) -> (T, D)), the routed experts wherever the placement puts them."""
        chosen, weights = route(s, layer, x, input_ids)
        if counts is not None:
            assert real is not None
            tally(counts, chosen, real)
        out = self.routed(i, x, chosen, weights)
        if layer.shared is not None:
            out = out + shared_expert(layer.shared, x, self.limit)
        return out

    def routed(self, i: int, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        T, k = chosen.shape
        D = x.shape[1]
        slots, replicas = self.tables[i]
        spr = self.placement.slots_per_rank
        rows = torch.arange(T, device=x.device).repeat_interleave(k)  # (P,) pair p = t k + j -> row t
        flat = chosen.flatten()
        slot = slots[flat, rows % replicas[flat]]  # (P,) physical slot of each pair
        dest = slot // spr
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
        sizes = torch.bincount(dest, minlength=self.group.world)  # (W,) pairs bound for each rank
        recv = self.group.exchange_counts(sizes)
        send = sizes.tolist()
        xin = self.group.all_to_all(x[rows[order]], send, recv)  # (N, D) rows others sent here
        local = self.group.all_to_all(slot[order] % spr, send, recv)  # (N,) their local slots
        back = self.group.all_to_all(self.compute(i, xin, local), recv, send)  # (P, D) in `order`
        y = torch.empty_like(back)
        y[order] = back  # pair order
        out = (y.float() * weights.flatten()[:, None]).view(T, k, D).sum(1)
        return out.to(x.dtype)

    def compute(self, i: int, x: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """x (N, D) rows through their local slots (N,) -> (N, D), unweighted."""
        if x.shape[0] == 0:
            return x.new_zeros(x.shape)
        ex = self.local[i]
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
        if self.triton:
            return fused_moe(x, local[:, None], ones, ex.w13, ex.w2, self.limit)
        return experts(ex, x, local[:, None], ones, self.limit)

    def idle(self, s: DeepseekV4Spec) -> None:
        """A step in which this rank has no rows: it still takes its part in every layer's exchange."""
        x = torch.empty(0, s.hidden_size, dtype=self.dtype, device=self.group.device)
        empty = torch.empty(0, s.experts_per_token, dtype=torch.int64, device=x.device)
        for i in range(self.placement.layers):
            self.routed(i, x, empty, empty.float())

    # --- a new placement, between two steps ----------------------------------------------------------------------

    def apply(self, new: Placement) -> int:
        """Every rank at once: receive the experts its new slots need (from the lowest rank holding each), build
        the new local stacks beside the running ones, then switch stacks and routing tables together. Returns
        the bytes this rank received."""
        self.check(new)
        transfers = self.placement.transfers(new)
        me = self.group.rank
        got: dict[tuple[int, int], list[torch.Tensor]] = {}
        sends, recvs = [], []
        for n, t in enumerate(transfers):
            parts = _parts(self._expert(t.layer, t.expert)) if t.src == me else None
            if t.dst == me:
                like = _parts(_take(self.local[t.layer], [0]))  # same shapes and dtypes as one local slot
                got[(t.layer, t.slot)] = [torch.empty_like(p) for p in like]
                recvs += [(p, t.src, n * 4 + j) for j, p in enumerate(got[(t.layer, t.slot)])]
            if parts is not None:
                sends += [(p.contiguous(), t.dst, n * 4 + j) for j, p in enumerate(parts)]
        self.group.exchange(sends, recvs)
        received = sum(p.nbytes for ps in got.values() for p in ps)
        self.local[:] = [self._rebuild(layer, new, got) for layer in range(new.layers)]  # in place: attach's
        self.placement = new
        self.tables = [new.table(i, self.group.device) for i in range(new.layers)]
        return received

    def check(self, new: Placement) -> None:
        """ValueError unless `new` places this model's experts and layers on this group's ranks (rank 0 asks
        before it tells the others: a placement they cannot take must never reach them)."""
        have = (self.placement.experts, self.placement.ranks, self.placement.layers)
        if (new.experts, new.ranks, new.layers) != have:
            raise ValueError(f"a placement of {new.experts} experts, {new.ranks} ranks, {new.layers} layers; "
                             f"this group runs {have[0]}, {have[1]}, {have[2]}")

    def _expert(self, layer: int, expert: int) -> Experts:
        """One logical expert this rank holds now, as a (1, ...) stack."""
        return _take(self.local[layer], [self.placement.local(layer, self.group.rank).index(expert)])

    def _rebuild(self, layer: int, new: Placement, got: dict[tuple[int, int], list[torch.Tensor]]) -> Experts:
        me, spr = self.group.rank, new.slots_per_rank
        if new.local(layer, me) == self.placement.local(layer, me):
            return self.local[layer]
        ones = []
        for j, expert in enumerate(new.local(layer, me)):
            slot = me * spr + j
            ones.append(_assemble(self.local[layer], got[(layer, slot)]) if (layer, slot) in got
                        else self._expert(layer, expert))
        return _cat(ones)


# --- stacked expert weights, dense or FP4 ------------------------------------------------------------------------

def _take(ex: Experts, idx: list[int]) -> Experts:
    return Experts(_rows(ex.w13, idx), _rows(ex.w2, idx))


def _rows(w: Weight, idx: list[int]) -> Weight:
    if isinstance(w, Fp4Weight):
        return Fp4Weight(w.data[idx].contiguous(), w.scale[idx].contiguous(), w.block)
    return w[idx].contiguous()


def _parts(ex: Experts) -> list[torch.Tensor]:
    """The tensors a transfer moves, in a fixed order: w13 then w2, each its data (and FP4 scales)."""
    return [t for w in (ex.w13, ex.w2) for t in ((w.data, w.scale) if isinstance(w, Fp4Weight) else (w,))]


def _assemble(like: Experts, parts: list[torch.Tensor]) -> Experts:
    """_parts' inverse, the formats taken from `like`."""
    it = iter(parts)

    def one(w: Weight) -> Weight:
        return Fp4Weight(next(it), next(it), w.block) if isinstance(w, Fp4Weight) else next(it)

    return Experts(one(like.w13), one(like.w2))


def _cat(ones: list[Experts]) -> Experts:
    def cat(ws: list[Weight]) -> Weight:
        if isinstance(ws[0], Fp4Weight):
            return Fp4Weight(torch.cat([w.data for w in ws]), torch.cat([w.scale for w in ws]), ws[0].block)
        return torch.cat(ws)

    return Experts(cat([e.w13 for e in ones]), cat([e.w2 for e in ones]))

