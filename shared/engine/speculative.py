"""Speculative decoding: verify a step's drafts, then a drafter (drafters/: the MTP layer, n-gram lookup) drafts the
next ones, as many as the verify-length policy allows (verify_policy.py).

    step N:  chunk = [last token, d1, d2, d3]  -> every row sampled: t1 t2 t3 t4
    verify:  keep d_i while t_i == d_i; the first disagreement's t (or t4 after the last draft) is the model's own
    draft:   the drafter proposes up to k drafts after the new last token (MTP: fed the kept rows' streams first)

The output is exactly what decoding without drafts gives: same sampler, same output positions; a rejected
draft's row is taken back (its sequence's num_computed stops at the kept rows, its rings by moving `length`).
A plain function: the engine calls verify after sampling and the drafter after resolving (engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.processors import LogitsProcessors
from shared.engine.scheduler import StepPlan
from shared.engine.verify_policy import VerifyPolicy


@dataclass
class Acceptance:
    drafted: int = 0  # drafts proposed so far
    accepted: int = 0  # ... and accepted: the acceptance rate is accepted / drafted
    verifies: int = 0  # chunks that verified drafts: mean accepted length is 1 + accepted / verifies


def verify(plan: StepPlan, sampled: list[int], processors: LogitsProcessors, acceptance: Acceptance,
           policy: VerifyPolicy | None = None) -> list[int | list[int]]:
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
        acceptance.verifies += 1
        if policy is not None:
            policy.verified(c.seq.request_id, len(c.drafts), keep)
        out.append(tokens[: keep + 1])
        processors.accept(c.seq, tokens[: keep + 1])
    return out
