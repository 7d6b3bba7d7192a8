"""workers -> balancer (and the gateway's fleet view): heartbeats (who is alive, how loaded, how it names KV
blocks) and the end of a worker's part of a request."""

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
    # how the worker names its KV blocks, so a balancer can hash a prompt the way it does (shared/hashing.py):
    # namespace(cache_id, request salt) and blocks of block_tokens; "" / 0 = unknown (no cache-aware routing)
    cache_id: str = ""
    block_tokens: int = 0
    # for /metrics (vLLM's num_requests_waiting and spec_decode_* series): of `running`, the sequences not
    # admitted yet; and the worker's speculative drafts proposed / accepted since it started, and the decode chunks
    # that verified them (counters: mean accepted length = 1 + accepted / verifies)
    waiting: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_verifies: int = 0


@dataclass(frozen=True)
class RequestDone:
    """A worker's part of a request is over (finished, failed, aborted or handed on), on `workers.done`.

    The balancer drops its assignment on this, so it knows exactly which requests a lost worker held.
    """

    request_id: str
    worker_id: str
    role: str  # "prefill" | "decode"
    migration: int = 0  # the request's migration that ended here (GenerateRequest.migration)
