"""gateway -> launcher (`deepinfer up`): the processes it supervises, for /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LauncherStats:
    """On `launcher.stats`: the launcher answers with every process it runs, nats-server included."""


@dataclass(frozen=True)
class ProcessState:
    instance: str  # "decode-0", "nats-server"
    service: str  # "decode", "nats"
    running: bool
    restarts: int  # since the launcher started
    crash_looping: bool  # dying again and again (shared/launch/backoff.py): restarted with a growing delay
    restart_in_s: float = 0.0  # while dead and backing off: seconds until the next start


@dataclass(frozen=True)
class LauncherStatsReply:
    instance: str
    processes: list[ProcessState] = field(default_factory=list)
