"""Speculative decoding: verify a step's drafts, then a drafter (drafters/: the MTP layer, n-gram lookup) drafts the
next ones, as many as the verify-length policy allows (verify_policy.py).

    step N:  chunk = [last token, d1, d2, d3]  -> every row sampled: t1 t2 t3 t4
    verify:  keep d_i while t_i == d_i; the first disagreement's t (or t4 after the last draft) is the model's own
    draft:   the drafter proposes up to k drafts after the new last token (MTP: fed the kept rows' streams first)

The output is exactly what decoding without drafts gives: same sampler, same output positions; a rejected
draft's row is taken back (its sequence's num_computed stops at the kept rows, its rings by moving `length`).
A plain function: the engine calls verify after sampling and the drafter after resolving (engine.py).

Overlap (engine.py): a step with drafts is resolved before the next is scheduled, since the next chunk starts
after however many drafts it accepts. A step without drafts may overlap the next launch, which then carries no
drafts either (the drafter has not seen the newest token): DraftGate decides, trading drafting for overlap only
where drafting would not pay. vLLM and SGLang overlap speculative steps by drafting on the device (EAGLE) and
fixing up positions there; our drafters are host-driven (prompt lookup, MTP's argmax per draft), so the
trade is per step instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.processors import LogitsProcessors
from shared.engine.scheduler import StepPlan
from shared.engine.sequence import Sequence
from shared.engine.verify_policy import VerifyPolicy

MAX_QUIET = 4  # most overlapped steps in a row after drafting passes that proposed nothing


class DraftGate:
    """Whether the step after a launched one is drafted (so launched only after that one resolves) or overlapped.

    Overlapped when the launched step has no drafts and either the policy's load cut-off allows none at this
    batch size (a full batch: overlap is worth more than drafts there) or the drafting passes found nothing to
    propose lately (free text under prompt lookup): after m such passes in a row the next m - 1 steps (at most
    MAX_QUIET) overlap before the drafter looks again; one miss alone costs nothing, since an accepted draft
    saves a whole step and overlap only the host's share of one. Only which steps draft changes: never a token."""

    def __init__(self) -> None:
        self.quiet = 0  # overlapped steps left before the drafter looks again
        self.misses = 0  # drafting passes in a row that proposed nothing

    def overlaps(self, has_drafts: bool, ceiling: int) -> bool:
        if has_drafts:
            return False
        if ceiling == 0:
            return True
        if self.quiet > 0:
            self.quiet -= 1
            return True
        return False

    def drafted(self, proposed: bool) -> None:
        """After a drafting pass: whether it proposed any draft."""
        self.misses = 0 if proposed else self.misses + 1
        self.quiet = min(max(0, self.misses - 1), MAX_QUIET)


@dataclass
class Budget:
    """The policy as one drafting pass sees it (drafters.Budget): nothing to draft while a step is in flight."""

    policy: VerifyPolicy
    batch: int
    drafting: bool

    def limit(self, seq: Sequence, match: int | None) -> int:
        return self.policy.length(seq.request_id, match, self.batch) if self.drafting else 0

    def floor(self) -> float:
        return self.policy.floor()

    def drafted(self, seq: Sequence, probs: list[float]) -> None:
        self.policy.drafted(seq.request_id, probs)


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
