"""Admission control as pure code: the bound per model, the token bound, Retry-After from observed lifetimes."""

from __future__ import annotations

import pytest

from services.recipe.admission import AdmissionLimits, Ledger, Load, decide, retry_after


def test_unbounded_admits_everything() -> None:
    assert decide(Load(10_000, 10**9, 5.0), 10**6, AdmissionLimits()) is None


def test_the_request_bound_refuses_at_the_limit_not_before() -> None:
    limits = AdmissionLimits(max_requests=3)
    assert decide(Load(2, 30), 10, limits) is None
    refusal = decide(Load(3, 30), 10, limits)
    assert refusal is not None and refusal.limit == "requests" and "limit is 3" in refusal.message


def test_the_token_bound_counts_the_new_prompt() -> None:
    limits = AdmissionLimits(max_tokens=100)
    assert decide(Load(2, 60), 40, limits) is None  # exactly at the bound
    refusal = decide(Load(2, 60), 41, limits)
    assert refusal is not None and refusal.limit == "tokens"


def test_an_idle_model_admits_a_prompt_past_the_token_bound() -> None:
    # refused forever otherwise: the context checks already bound one request
    assert decide(Load(0, 0), 5_000, AdmissionLimits(max_requests=1, max_tokens=100)) is None


def test_retry_after_follows_the_observed_lifetime() -> None:
    assert retry_after(Load(4, 0, 0.0), 1) == 1  # nothing finished yet: the minimum
    assert retry_after(Load(4, 0, 10.0), 1) == 3  # one of 4 requests of 10 s ends every 2.5 s
    assert retry_after(Load(4, 0, 10.0), 2) == 5
    assert retry_after(Load(1, 0, 1e6), 1) == 60  # capped
    refusal = decide(Load(4, 400, 8.0), 200, AdmissionLimits(max_tokens=500))
    assert refusal is not None and refusal.retry_after_s == 2  # 100 tokens over = 1 average request: 8 s / 4


def test_negative_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        AdmissionLimits(max_requests=-1)


def test_the_ledger_counts_per_model_and_forgets_on_leave() -> None:
    ledger = Ledger(AdmissionLimits(max_requests=2))
    ledger.enter("a", "m", 10, now=0.0)
    ledger.enter("b", "m", 20, now=0.0)
    ledger.enter("c", "other", 5, now=0.0)
    assert ledger.load("m") == Load(2, 30, 0.0)
    assert ledger.check("m", 1) is not None and ledger.check("other", 1) is None
    ledger.leave("a", now=4.0)
    ledger.leave("a", now=5.0)  # a second end of the same request changes nothing
    ledger.leave("unknown", now=5.0)
    assert ledger.load("m") == Load(1, 20, 4.0)
    assert ledger.check("m", 1) is None
    ledger.leave("b", now=14.0)  # lived 14 s: the estimate moves a fifth of the way
    assert ledger.load("m").lifetime_s == pytest.approx(4.0 + 0.2 * 10.0)
    assert ledger.load("m").requests == 0 and ledger.load("m").tokens == 0
