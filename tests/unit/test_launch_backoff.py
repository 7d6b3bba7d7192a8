"""The restart rule of `deepinfer up` (shared/launch/backoff.py): pure, on a test clock."""

from __future__ import annotations

from shared.launch.backoff import CRASH_LOOP_EXITS, MAX_DELAY_S, STABLE_S, RestartPolicy, delay


def test_the_delay_doubles_from_the_second_quick_death_and_is_capped() -> None:
    assert [delay(n) for n in range(1, 6)] == [0.0, 1.0, 2.0, 4.0, 8.0]
    assert delay(50) == MAX_DELAY_S


def test_quick_deaths_in_a_row_are_a_crash_loop_and_a_long_run_ends_it() -> None:
    policy, now = RestartPolicy(), 1000.0
    for n in range(CRASH_LOOP_EXITS):
        assert not policy.crash_looping()
        policy.died(started_at=now, now=now + 1)  # each run lived 1 s
        now += 1 + delay(n + 1)
    assert policy.crash_looping() and policy.streak == CRASH_LOOP_EXITS
    assert not policy.settle(started_at=now, now=now + STABLE_S - 1)  # not yet stable
    assert policy.settle(started_at=now, now=now + STABLE_S)  # said once...
    assert not policy.crash_looping() and not policy.settle(started_at=now, now=now + 2 * STABLE_S)  # ...only once
    assert policy.total == CRASH_LOOP_EXITS


def test_a_death_after_a_long_run_is_a_first_death_again() -> None:
    policy = RestartPolicy()
    assert policy.died(started_at=0.0, now=1.0) == 0.0
    assert policy.died(started_at=1.0, now=2.0) == 1.0
    assert policy.died(started_at=2.0, now=2.0 + STABLE_S) == 0.0  # it had run STABLE_S: the streak restarts
    assert policy.streak == 1 and policy.total == 3
