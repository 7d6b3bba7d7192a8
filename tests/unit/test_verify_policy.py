"""The verify-length policy alone: fixed K, and the adaptive one as a pure function of the drafter's confidence,
the request's acceptance history and the batch's load."""

from __future__ import annotations

import pytest

from shared.engine.speculative import MAX_QUIET, DraftGate
from shared.engine.verify_policy import (BINS, CONFIDENT, LOAD_FULL, LOAD_NONE, PRIOR, Adaptive, FixedK,
                                         adaptive_length, calibrate, confidence_cut, confidence_floor, history_cap,
                                         load_cap, make_policy, match_cap)


def test_fixed_k_ignores_everything() -> None:
    p = FixedK(4)
    p.verified("a", 4, 0)
    assert [p.length("a", m, b) for m, b in [(None, 1), (1, 1), (3, 512)]] == [4, 4, 4]


def test_load_cap_falls_to_zero_on_large_batches() -> None:
    assert load_cap(4, 1) == load_cap(4, LOAD_FULL) == 4
    assert load_cap(4, LOAD_NONE) == load_cap(4, 10 * LOAD_NONE) == 0
    middle = [load_cap(4, b) for b in range(LOAD_FULL, LOAD_NONE + 1)]
    assert middle == sorted(middle, reverse=True) and 0 < load_cap(4, (LOAD_FULL + LOAD_NONE) // 2) < 4


def test_match_cap_trusts_long_matches() -> None:
    assert [match_cap(4, m) for m in (None, 0, 1, 2, 3, 5)] == [4, 0, 1, 2, 4, 4]
    assert match_cap(1, 2) == 1


def test_history_cap_from_the_per_draft_acceptance() -> None:
    assert history_cap(4, 1.0) == 4 and history_cap(4, 0.95) == 4
    assert history_cap(4, 0.6) == 2 and history_cap(4, 0.5) == 1 and history_cap(4, 0.0) == 1


def test_adaptive_length_is_the_least_cap() -> None:
    assert adaptive_length(4, 3, 0.95, 1) == 4
    assert adaptive_length(4, 1, 0.95, 1) == 1  # a 1-token match
    assert adaptive_length(4, 3, 0.5, 1) == 1  # a request that rejects most drafts
    assert adaptive_length(4, 3, 0.95, LOAD_NONE) == 0  # a full batch verifies nothing
    assert adaptive_length(4, None, 0.95, 2) == 4  # MTP: no confidence before drafting


def test_adaptive_learns_each_requests_acceptance() -> None:
    p = Adaptive(4)
    assert p.length("a", 3, 1) == history_cap(4, PRIOR)  # no history yet: the prior
    for _ in range(6):
        p.verified("a", 4, 4)  # every draft kept
        p.verified("b", 4, 0)  # every draft rejected
    assert p.length("a", 3, 1) == 4 and p.length("b", 3, 1) == 1
    for _ in range(10):
        p.verified("a", 4, 0)  # "a" stops accepting: recent steps weigh most
    assert p.length("a", 3, 1) == 1
    p.drop("a")
    assert "a" not in p.history and p.length("a", 3, 1) == history_cap(4, PRIOR)


def test_confidence_cut_stops_at_the_first_draft_below_the_floor() -> None:
    assert confidence_cut([0.9, 0.7, 0.3, 0.9], 0.5) == 2  # the third is doubtful: it and what follows go
    assert confidence_cut([0.9, 0.8], 0.5) == 2 and confidence_cut([], 0.5) == 0
    assert confidence_cut([0.1, 0.9], 0.5) == 1  # the first is always drafted (the calibration learns from it)
    assert confidence_cut([0.1, 0.2], 0.0) == 2  # floor 0: never stops early
    assert confidence_cut([0.9, 0.5], 0.5) == 2 and confidence_cut([0.9, 0.49], 0.5) == 1


def test_confidence_floor_is_learned_from_acceptance() -> None:
    empty = [0.0] * BINS
    # no history: each bin trusts its own midpoint, so the floor is the first edge at or above CONFIDENT
    assert confidence_floor(empty, empty) == pytest.approx(CONFIDENT)
    kept, tried = [0.0] * BINS, [0.0] * BINS
    for _ in range(20):  # a drafter whose 0.2..0.3 drafts are nearly always kept, and 0.1..0.2 ones never
        calibrate(kept, tried, [0.95, 0.25, 0.25, 0.15], 3)
    low = confidence_floor(kept, tried)
    assert low == pytest.approx(0.2)  # its floor falls to the bin that is still accepted
    assert confidence_cut([0.95, 0.25, 0.15], low) == 2
    for _ in range(20):  # now its 0.9+ drafts are rejected at once: nothing below them is tested either
        calibrate(kept, tried, [0.95, 0.25], 0)
    assert confidence_floor(kept, tried) == 1.0  # the top bin fails: drafting stops after the first draft
    assert confidence_cut([0.95, 0.99], 1.0) == 1


def test_calibrate_counts_only_tested_drafts() -> None:
    kept, tried = [0.0] * BINS, [0.0] * BINS
    calibrate(kept, tried, [0.95, 0.55, 0.35, 0.05], 1)  # kept the first, rejected the second, never tested the rest
    assert tried[9] == kept[9] == 1 and (tried[5], kept[5]) == (1, 0) and tried[3] == tried[0] == 0
    calibrate(kept, tried, [1.0], 1)  # probability 1 falls in the top bin
    assert kept[9] == pytest.approx(1 * 0.8 + 1)


def test_adaptive_pairs_probabilities_with_their_verify() -> None:
    p = Adaptive(4)
    assert FixedK(4).floor() == 0.0 and p.floor() == confidence_floor([0.0] * BINS, [0.0] * BINS)
    for _ in range(15):
        p.drafted("a", [0.3, 0.3, 0.3, 0.3])
        p.verified("a", 4, 4)  # 0.3-probability drafts always kept
    assert p.floor() <= 0.3 and not p.probs
    p.drafted("b", [0.9, 0.9])
    p.verified("b", 1, 0)  # the scheduler verified one of two (length limit): only that one is counted
    p.drafted("c", [0.9])
    p.drop("c")
    assert not p.probs


def test_load_ceiling_and_draft_gate() -> None:
    assert FixedK(3).ceiling(10 * LOAD_NONE) == 3
    assert Adaptive(3).ceiling(1) == 3 and Adaptive(3).ceiling(LOAD_NONE) == 0
    g = DraftGate()
    assert not g.overlaps(True, 0)  # a step with drafts never overlaps: the next chunk follows its accepted count
    assert g.overlaps(False, 0) and not g.overlaps(False, 3)  # a full batch overlaps; else the drafter looks
    g.drafted(False)
    assert not g.overlaps(False, 3)  # one empty pass costs nothing
    seen = []
    for _ in range(MAX_QUIET + 3):  # empty passes in a row: ever longer overlapped runs, at most MAX_QUIET
        g.drafted(False)
        run = 0
        while g.overlaps(False, 3):
            run += 1
        seen.append(run)
    assert seen == sorted(seen) and seen[0] == 1 and seen[-1] == MAX_QUIET
    g.drafted(True)
    assert not g.overlaps(False, 3)  # a pass that proposes: the drafter looks every step again


def test_unknown_policy_is_refused() -> None:
    assert isinstance(make_policy("fixed", 2), FixedK) and isinstance(make_policy("adaptive", 2), Adaptive)
    with pytest.raises(ValueError, match="fixed"):
        make_policy("greedy", 2)


def test_worker_flags_name_every_method_and_policy() -> None:
    from shared.engine.drafters import METHODS
    from shared.engine.verify_policy import POLICIES
    from shared.worker.config import SPECULATIVE_METHODS, SPECULATIVE_POLICIES, WorkerConfig

    assert (SPECULATIVE_METHODS, SPECULATIVE_POLICIES) == (METHODS, POLICIES)
    with pytest.raises(ValueError, match="--speculative-method"):
        WorkerConfig(device="cpu", speculative_method="eagle")
    with pytest.raises(ValueError, match="--speculative-policy"):
        WorkerConfig(device="cpu", speculative_policy="dspark")
