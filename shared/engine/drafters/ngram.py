"""Prompt-lookup (n-gram) drafting for any model: no weights, just the sequence's own tokens.

    tokens   ... A B C x y z ... A B C        the last n tokens (n from max_n down to min_n) occurred before
    drafts                   x y z            -> propose what followed their latest earlier occurrence, up to k

Pays where the output copies its context (code edits, summaries that quote, RAG answers); proposes nothing when
no suffix recurs, so free text costs no verify rows. The matched length is the drafter's confidence: the
verify-length policy may draft fewer after a short match.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shared.engine.drafters import Budget
from shared.engine.scheduler import Scheduler, StepPlan
from shared.engine.sequence import Status

MAX_N, MIN_N = 3, 1


def lookup(tokens: list[int], k: int, max_n: int = MAX_N, min_n: int = MIN_N) -> tuple[list[int], int]:
    """(up to k tokens that followed the latest earlier occurrence of the longest recurring suffix, its length);
    ([], 0) when no suffix of min_n..max_n tokens occurred before with a token after it."""
    if k <= 0 or len(tokens) < min_n + 1:
        return [], 0
    ids = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        # windows starting at 0 .. len - n - 1: each earlier occurrence leaves at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + k].tolist(), n
    return [], 0


class NgramDrafter:
    reads_hidden = False

    def __init__(self, max_drafts: int, max_n: int = MAX_N, min_n: int = MIN_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_drafts, self.max_n, self.min_n = max_drafts, max_n, min_n

    def propose(self, kv: Any, plan: StepPlan, hidden: torch.Tensor | None, scheduler: Scheduler, budget: Budget
                ) -> None:
        """Drafts for every sequence the step sampled that decodes next (its tokens are all known: the engine
        drafts only when no step is in flight, so no placeholder is left)."""
        for c in plan.chunks:
            seq = c.seq
            if not c.sample or scheduler.seqs.get(seq.request_id) is not seq or seq.status is not Status.RUNNING:
                continue  # a prefill chunk before its last, finished or aborted
            seq.drafts = []
            k = budget.limit(seq, None)  # 0: no drafting this step (overlapped), so no lookup either
            if k > 0:
                drafts, match = lookup(seq.token_ids, self.max_drafts, self.max_n, self.min_n)
                seq.drafts = drafts[: budget.limit(seq, match)] if drafts else []
