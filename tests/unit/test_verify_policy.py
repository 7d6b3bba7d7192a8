"""The verify-length policy alone: fixed K, and the adaptive one as a pure function of the drafter's confidence,
the request's acceptance history and the batch's load."""

from __future__ import annotations

import pytest

from shared.engine.verify_policy import (LOAD_FULL, LOAD_NONE, PRIOR, Adaptive, FixedK, adaptive_length,
                                         history_cap, load_cap, make_policy, match_cap)


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
