"""When to restart a process that died: at once the first time, then after a delay that doubles with each quick
death in a row, capped (Kubernetes' CrashLoopBackOff, shorter). A service that keeps dying costs one restart
every MAX_DELAY_S, never the rest of the stack; one that then stays up STABLE_S is out of the loop again.

Pure: the launcher passes the clock, so the rule is tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

CRASH_LOOP_EXITS = 5  # quick deaths in a row that make a crash loop (reported as such)
STABLE_S = 60.0  # a run at least this long ends the streak: its next death is a first one again
FIRST_DELAY_S = 1.0  # before the 2nd restart of a streak; doubles each time
MAX_DELAY_S = 60.0


@dataclass
class RestartPolicy:
    streak: int = 0  # deaths in a row, each within STABLE_S of its start
    total: int = 0  # restarts so far (for metrics)

    def died(self, started_at: float, now: float) -> float:
        """Record a death of a run started at `started_at`; the seconds to wait before restarting it."""
        if now - started_at >= STABLE_S:
            self.streak = 0
        self.streak += 1
        self.total += 1
        return delay(self.streak)

    def crash_looping(self) -> bool:
        return self.streak >= CRASH_LOOP_EXITS

    def settle(self, started_at: float, now: float) -> bool:
        """Called while it runs: True once (the streak then ends) when a run of a crash-looping process has lasted
        STABLE_S, so the launcher can say it recovered."""
        if self.streak and now - started_at >= STABLE_S:
            was_looping = self.crash_looping()
            self.streak = 0
            return was_looping
        return False


def delay(streak: int) -> float:
    """0 s for the first death of a streak, then 1, 2, 4, ... s, at most MAX_DELAY_S."""
    if streak <= 1:
        return 0.0
    return min(FIRST_DELAY_S * 2 ** (streak - 2), MAX_DELAY_S)
