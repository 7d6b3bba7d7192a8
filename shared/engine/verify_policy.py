"""How many drafts a sequence verifies this step: the verify-length policy (--speculative-policy).

    fixed     always the maximum K (--speculative-tokens): the baseline
    adaptive  the least of: K; what the request's recent acceptance makes worth verifying; what the drafter's
              confidence allows (n-gram: a 1-token match drafts 1, a 2-token match half of K; MTP: drafting
              stops at the first draft whose probability is below a floor learned from acceptance history);
              what the batch load allows (full K up to LOAD_FULL sequences, none from LOAD_NONE on: a large
              batch is compute-bound, so a rejected draft row costs a real token's compute)

The policy only shortens drafts; verification keeps the output that of plain decoding whatever it decides.
Acceptance history is per request: each verify of k drafts that kept `a` is a + (a < k) Bernoulli trials of
which a succeeded (drafts after the first rejection were never tested), decayed so recent steps weigh most.

MTP confidence (DSpark / vLLM #47808's confidence scheduling): the draft layer's probability for each draft it
proposes. The engine-wide calibration keeps, per probability bin (BINS of equal width), how many drafts were
tested and kept; the floor is the lowest bin edge from which the bins up accept at least CONFIDENT of their
drafts (confidence_floor). Drafting stops at the first draft below it (confidence_cut). The floor is the
drafter's (one layer's calibration), not a request's: every request teaches it.
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
BINS = 10  # draft-probability bins of the confidence calibration
CONFIDENT = 0.5  # a bin whose drafts are kept at least this often is above the floor
EVIDENCE = 2.0  # decayed tested drafts before a bin's own acceptance counts


class VerifyPolicy(Protocol):
    def length(self, request_id: str, match: int | None, batch: int) -> int: ...

    def ceiling(self, batch: int) -> int:
        """The most drafts any request may verify at this load (0: the engine keeps overlapping instead)."""
        ...

    def floor(self) -> float:
        """A draft probability below which the MTP drafter stops drafting (0: never stops early)."""
        ...

    def drafted(self, request_id: str, probs: list[float]) -> None:
        """The probabilities of the drafts just proposed for the request (its next verify pairs them)."""
        ...

    def verified(self, request_id: str, drafted: int, accepted: int) -> None: ...

    def drop(self, request_id: str) -> None: ...


class FixedK:
    def __init__(self, k: int) -> None:
        self.k = k

    def length(self, request_id: str, match: int | None, batch: int) -> int:
        return self.k

    def ceiling(self, batch: int) -> int:
        return self.k

    def floor(self) -> float:
        return 0.0

    def drafted(self, request_id: str, probs: list[float]) -> None:
        pass

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


def confidence_floor(kept: list[float], tried: list[float]) -> float:
    """The learned draft-probability floor from the calibration bins (kept[b], tried[b]: decayed drafts with a
    probability in [b / BINS, (b + 1) / BINS) kept and tested). From the top bin down, a bin with evidence (at
    least EVIDENCE drafts tested) lowers the floor to its lower edge while it accepts at least CONFIDENT of its
    drafts (its midpoint counting as one prior trial), and the first that does not ends the scan; a bin without
    evidence lowers it only if its midpoint reaches CONFIDENT (the prior trusts the probability as it is), and
    otherwise neither lowers nor stops it. So with no history the floor is the first edge whose midpoint
    reaches CONFIDENT, and a drafter that is better than its probabilities say earns a lower one."""
    n = len(kept)
    floor = 1.0
    for b in range(n - 1, -1, -1):
        mid = (b + 0.5) / n
        if tried[b] >= EVIDENCE:
            if (kept[b] + mid) / (tried[b] + 1) < CONFIDENT:
                break
            floor = b / n
        elif mid >= CONFIDENT:
            floor = b / n
    return floor


def confidence_cut(probs: list[float], floor: float) -> int:
    """How many of the drafts (their probabilities, in order) to verify: those before the first below the floor,
    but at least the first (as history_cap's one: the calibration learns only from drafts that are tested)."""
    first_doubt = next((i for i, p in enumerate(probs) if p < floor), len(probs))
    return min(len(probs), max(1, first_doubt))


def calibrate(kept: list[float], tried: list[float], probs: list[float], accepted: int) -> None:
    """One verify's drafts into the bins (in place, after decaying them): the first `accepted` were kept, the
    next one was tested and rejected (if any), the rest were never tested."""
    n = len(kept)
    for b in range(n):
        kept[b] *= DECAY
        tried[b] *= DECAY
    for i, p in enumerate(probs[: accepted + 1]):
        b = min(n - 1, max(0, int(p * n)))
        tried[b] += 1
        kept[b] += i < accepted


class Adaptive:
    def __init__(self, k: int) -> None:
        self.k = k
        self.history: dict[str, History] = {}
        self.probs: dict[str, list[float]] = {}  # the request's drafts in flight: their probabilities
        self.kept, self.tried = [0.0] * BINS, [0.0] * BINS  # the drafter's calibration (confidence_floor)
        self._floor = confidence_floor(self.kept, self.tried)

    def length(self, request_id: str, match: int | None, batch: int) -> int:
        h = self.history.get(request_id)
        return adaptive_length(self.k, match, h.rate if h else PRIOR, batch)

    def ceiling(self, batch: int) -> int:
        return load_cap(self.k, batch)

    def floor(self) -> float:
        return self._floor

    def drafted(self, request_id: str, probs: list[float]) -> None:
        self.probs[request_id] = probs

    def verified(self, request_id: str, drafted: int, accepted: int) -> None:
        h = self.history.setdefault(request_id, History())
        h.kept = h.kept * DECAY + accepted
        h.tried = h.tried * DECAY + accepted + (accepted < drafted)
        probs = self.probs.pop(request_id, None)
        if probs is not None:  # the scheduler may have verified fewer than were proposed (length, budget)
            calibrate(self.kept, self.tried, probs[:drafted], accepted)
            self._floor = confidence_floor(self.kept, self.tried)

    def drop(self, request_id: str) -> None:
        self.history.pop(request_id, None)
        self.probs.pop(request_id, None)


def make_policy(name: str, k: int) -> VerifyPolicy:
    if name == "fixed":
        return FixedK(k)
    if name == "adaptive":
        return Adaptive(k)
    raise ValueError(f"speculative policy must be one of {list(POLICIES)}, got {name!r}")
