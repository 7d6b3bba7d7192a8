"""Speculative decoding with the model's own MTP layer: verify a step's drafts, then draft the next ones.

    step N:  chunk = [last token, d1, d2, d3]  -> every row sampled: t1 t2 t3 t4
    verify:  keep d_i while t_i == d_i; the first disagreement's t (or t4 after the last draft) is the model's own
    draft:   the MTP layer is fed the (streams, next token) pairs the kept rows made known, then proposes k drafts

The output is exactly what decoding without drafts gives: same sampler, same output positions; a rejected
draft's row is taken back (its sequence's num_computed stops at the kept rows, its rings by moving `length`).
Plain functions: the engine calls verify after sampling and draft after resolving (engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.processors import LogitsProcessors
from shared.engine.protocols import Cache, Drafts
from shared.engine.scheduler import Scheduler, StepPlan
from shared.engine.sequence import Status


@dataclass
class Acceptance:
    drafted: int = 0  # drafts proposed so far
    accepted: int = 0  # ... and accepted: the acceptance rate is accepted / drafted


def verify(plan: StepPlan, sampled: list[int], processors: LogitsProcessors, acceptance: Acceptance
           ) -> list[int | list[int]]:
    """Per sampled chunk: its token, or for a chunk with drafts the drafts the model itself would have
    produced followed by the model's own token at the first disagreement (or after the last draft)."""
    out: list[int | list[int]] = []
    at = 0
    for c in plan.chunks:
        if not c.sample:
            continue
        if not c.drafts:
            out.append(sampled[at])
            processors.accept(c.seq, [sampled[at]])
            at += 1
            continue
        tokens = sampled[at : at + c.num_tokens]
        at += c.num_tokens
        keep = next((i for i, d in enumerate(c.drafts) if tokens[i] != d), len(c.drafts))
        acceptance.drafted += len(c.drafts)
        acceptance.accepted += keep
        out.append(tokens[: keep + 1])
        processors.accept(c.seq, tokens[: keep + 1])
    return out


def draft(model: Drafts, kv: Cache, plan: StepPlan, hidden: torch.Tensor, scheduler: Scheduler, k: int) -> None:
    """Feed the MTP layer the pairs a resolved step made known (`hidden`: its rows, in chunk order), then give
    every sequence that decodes next up to k drafts (seq.drafts)."""
    row = 0
    for c in plan.chunks:
        seq, rows = c.seq, hidden[row : row + c.num_tokens]
        row += c.num_tokens
        if scheduler.seqs.get(seq.request_id) is not seq or seq.status is not Status.RUNNING:
            continue  # finished or aborted
        kept = seq.num_computed - c.start  # rows whose tokens stayed (verified drafts, not rejected ones)
        nexts = seq.token_ids[c.start + 1 : c.start + kept + 1]  # the token after each kept row, if known
        out = model.mtp_advance(kv, seq.request_id, c.start, rows[:kept], nexts)
        seq.drafts = []
        if out is not None and c.sample:
            seq.drafts = model.mtp_draft(kv, seq.request_id, out, c.start + kept, k)
