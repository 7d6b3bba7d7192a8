"""Worker registry traffic: heartbeats and health."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Heartbeat:
    worker_id: str
    role: str  # "prefill" | "decode"
    model: str
    queued_tokens: int  # prompt tokens waiting or being computed
    running: int  # sequences held
    free_blocks: int
    total_blocks: int
    sent_at: float


@dataclass(frozen=True)
class HealthRequest:
    pass


@dataclass(frozen=True)
class HealthReply:
    service: str
    instance: str
    ready: bool
    detail: str = ""
