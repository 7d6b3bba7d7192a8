"""The MTP drafter: DeepSeek-V4's draft layer, fed the (stream, next token) pairs a resolved step made known, then
asked for up to k drafts (k from the verify-length policy, which has no confidence before drafting: match None).

Its confidence comes with the drafts: each one's probability under the draft layer. Drafting stops before the
first below the policy's floor, and the probabilities go back to the policy, which learns the floor from how
often drafts of each probability were accepted (verify_policy.py)."""

from __future__ import annotations

from typing import Any

import torch

from shared.engine.drafters import Budget
from shared.engine.protocols import Drafts, drafter
from shared.engine.scheduler import Scheduler, StepPlan
from shared.engine.sequence import Status


class MtpDrafter:
    reads_hidden = True

    def __init__(self, model: Drafts) -> None:
        self.model = model

    @classmethod
    def of(cls, model: object) -> MtpDrafter:
        drafts = drafter(model)
        if drafts is None:
            raise ValueError(f"{type(model).__name__}: no MTP layer to draft speculative tokens with "
                             "(--speculative-method ngram drafts for any model)")
        return cls(drafts)

    def propose(self, kv: Any, plan: StepPlan, hidden: torch.Tensor | None, scheduler: Scheduler, budget: Budget
                ) -> None:
        """Feed the MTP layer the pairs a resolved step made known (`hidden`: its rows, in chunk order), then give
        every sequence that decodes next up to budget.limit(seq) drafts (seq.drafts)."""
        assert hidden is not None
        row = 0
        for c in plan.chunks:
            seq, rows = c.seq, hidden[row : row + c.num_tokens]
            row += c.num_tokens
            if scheduler.seqs.get(seq.request_id) is not seq or seq.status is not Status.RUNNING:
                continue  # finished or aborted
            # rows whose tokens stayed (verified drafts, not rejected ones); with the next step already in flight
            # (overlapped, no drafts) num_computed counts its row too: at most this chunk's rows
            kept = min(seq.num_computed - c.start, c.num_tokens)
            nexts = seq.token_ids[c.start + 1 : c.start + kept + 1]  # the token after each kept row, if known
            # the layer advances on every step, drafting or not: its ring must hold every position
            out = self.model.mtp_advance(kv, seq.request_id, c.start, rows[:kept], nexts)
            seq.drafts = []
            k = budget.limit(seq, None) if out is not None and c.sample else 0
            if k > 0:
                seq.drafts, probs = self.model.mtp_draft(kv, seq.request_id, out, c.start + kept, k, budget.floor())
                budget.drafted(seq, probs)
