"""How many drafts a sequence verifies this step: the verify-length policy (--speculative-policy).

    fixed     always the maximum K (--speculative-tokens): the baseline
    adaptive  the least of: K; what the request's recent acceptance makes worth verifying; what the drafter's
              confidence allows (n-gram: a 1-token match drafts 1, a 2-token match half of K); what the batch
              load allows (full K up to LOAD_FULL sequences, none from LOAD_NONE on: a large batch is
              compute-bound, so a rejected draft row costs a real token's compute)

The policy only shortens drafts; verification keeps the output that of plain decoding whatever it decides.
Acceptance history is per request: each verify of k drafts that kept `a` is a + (a < k) Bernoulli trials of
which a succeeded (drafts after the first rejection were never tested), decayed so recent steps weigh most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

POLICIES = ("fixed", "adaptive")
LOAD_FULL, LOAD_NONE = 8, 64  # decoding sequences: below the first K drafts, from the second none
PRIOR = 0.6  # assumed per-draft acceptance before a request has any history
DECAY = 0.8  # weight of the history per new verify
WORTH = 0.3  # verify draft i only while its chance of being reached and kept (p ** i) is at least this


class VerifyPolicy(Protocol):
    def length(self, request_id: str, match: int | None, batch: int) -> int: ...

    def verified(self, request_id: str, drafted: int, accepted: int) -> None: ...

    def drop(self, request_id: str) -> None: ...


class FixedK:
    def __init__(self, k: int) -> None:
        self.k = k

    def length(self, request_id: str, match: int | None, batch: int) -> int:
        return self.k

    def verified(self, request_id: str, drafted: int, accepted: int) -> None:
        pass

    def drop(self, request_id: str) -> None:
        pass


@dataclass
class History:
    kept: float = 0.0  # decayed drafts kept
    tried: float = 0.0  # decayed drafts tested (kept + the first rejected one)

    @property
    def rate(self) -> float:
        # the prior counts as one trial, so one early rejection does not stop a request drafting for good
        return (self.kept + PRIOR) / (self.tried + 1)


def load_cap(k: int, batch: int) -> int:
    """Drafts the batch's load allows: k up to LOAD_FULL decoding sequences, falling linearly to 0 at LOAD_NONE."""
    if batch <= LOAD_FULL:
        return k
    if batch >= LOAD_NONE:
        return 0
    return math.floor(k * (LOAD_NONE - batch) / (LOAD_NONE - LOAD_FULL))


def match_cap(k: int, match: int | None) -> int:
    """Drafts the drafter's confidence allows: no confidence (MTP) or a long match: k; 2 tokens: half; 1: one."""
    if match is None or match >= 3:
        return k
    return 0 if match <= 0 else 1 if match == 1 else max(1, k // 2)


def history_cap(k: int, rate: float) -> int:
    """Drafts worth verifying at per-draft acceptance `rate`: the largest i with rate ** i >= WORTH (at least 1,
    so a request keeps a chance to show it accepts again)."""
    if rate >= 1:
        return k
    if rate <= 0:
        return 1
    return max(1, min(k, math.floor(math.log(WORTH) / math.log(rate))))


def adaptive_length(k: int, match: int | None, rate: float, batch: int) -> int:
    """The adaptive policy as a pure function of the drafter's confidence, the request's acceptance and the load."""
    return min(k, load_cap(k, batch), match_cap(k, match), history_cap(k, rate))


class Adaptive:
    def __init__(self, k: int) -> None:
        self.k = k
        self.history: dict[str, History] = {}

    def length(self, request_id: str, match: int | None, batch: int) -> int:
        h = self.history.get(request_id)
        return adaptive_length(self.k, match, h.rate if h else PRIOR, batch)

    def verified(self, request_id: str, drafted: int, accepted: int) -> None:
        h = self.history.setdefault(request_id, History())
        h.kept = h.kept * DECAY + accepted
        h.tried = h.tried * DECAY + accepted + (accepted < drafted)

    def drop(self, request_id: str) -> None:
        self.history.pop(request_id, None)


def make_policy(name: str, k: int) -> VerifyPolicy:
    if name == "fixed":
        return FixedK(k)
    if name == "adaptive":
        return Adaptive(k)
    raise ValueError(f"speculative policy must be one of {list(POLICIES)}, got {name!r}")
