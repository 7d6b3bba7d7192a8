"""Drafters for speculative decoding, chosen by name (--speculative-method): one module each.

    mtp    the model's own MTP layer (DeepSeek-V4): needs the layer's weights
    ngram  prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n-gram;
           no weights, any model

A drafter runs after a step is resolved and leaves every sequence that decodes next its drafts (seq.drafts);
how many it may propose per sequence is the verify-length policy's (verify_policy.py), asked through a Budget.
Verification is the same for every drafter (speculative.verify), so the output is plain decoding's.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from shared.engine.scheduler import Scheduler, StepPlan
from shared.engine.sequence import Sequence

class Budget(Protocol):
    """What the verify-length policy allows one drafting pass (the engine's view of it for this step)."""

    def limit(self, seq: Sequence, match: int | None) -> int:
        """Drafts `seq` may propose; match: the drafter's confidence in its proposal before drafting (n-gram: the
        matched length), None when it has none (MTP: its confidence comes with the drafts, see floor)."""
        ...

    def floor(self) -> float:
        """MTP: a draft probability below which drafting stops (0: never early)."""
        ...

    def drafted(self, seq: Sequence, probs: list[float]) -> None:
        """The proposed drafts' probabilities (MTP), for the policy to pair with their verification."""
        ...


class Drafter(Protocol):
    def propose(self, kv: Any, plan: StepPlan, hidden: torch.Tensor | None, scheduler: Scheduler, budget: Budget
                ) -> None: ...


METHODS = ("mtp", "ngram")


def make_drafter(method: str, model: object, max_drafts: int) -> Drafter:
    """The drafter `method` names for `model`; ValueError when the model cannot draft that way."""
    if method == "mtp":
        from shared.engine.drafters.mtp import MtpDrafter

        return MtpDrafter.of(model)
    if method == "ngram":
        from shared.engine.drafters.ngram import NgramDrafter

        return NgramDrafter(max_drafts)
    raise ValueError(f"speculative method must be one of {list(METHODS)}, got {method!r}")


def needs_hidden(drafter: Drafter) -> bool:
    """Whether the drafter reads the step's hidden rows (the MTP layer does; prompt lookup does not)."""
    return bool(getattr(drafter, "reads_hidden", False))
