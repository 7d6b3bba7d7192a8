"""The request as the engine sees it: token ids and sampling, produced by the recipe."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top one's; 0 = off
    repetition_penalty: float = 1.0  # vLLM's / HF's: logits of tokens seen in prompt or output /(>0) or x(<0); 1 = off
    min_tokens: int = 0  # stop ids (EOS included) are masked until this many tokens were generated
    seed: int | None = None  # None = nondeterministic
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # the model's EOS ids do not end the sequence (stop_token_ids still do)


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    cache_salt: str = ""  # tenant salt for block hashes
    arrival: float = 0.0  # unix time at the gateway


@dataclass(frozen=True)
class PrefillJob:
    """balancer -> prefill worker."""

    request: GenerateRequest
    worker_id: str


@dataclass(frozen=True)
class DecodeJob:
    """prefill worker -> balancer -> decode worker.

    The prompt's KV is in the kvcache service: full blocks under `block_hashes` (the shared chained hash), and a
    short-term snapshot at the prompt's end under `snapshot_key` (the partial last block and the model's
    per-request state: shared/worker/short_term.py; b"" = none stored). `first_token` was sampled by prefill.

    With `peer_lease_s` > 0 the job left prefill before the store had the KV: the prefill worker holds it for
    a direct pull (`kv.peer.<prefill_worker>`, shared/worker/kv_peer.py) that long, while it stores it for later turns.
    """

    request: GenerateRequest
    first_token: int
    block_hashes: list[bytes]
    snapshot_key: bytes
    cached_tokens: int
    prefill_worker: str
    worker_id: str = ""  # filled by the decode balancer
    peer_lease_s: float = 0.0  # > 0: pull the prompt's KV from prefill_worker first (held there this long)


@dataclass(frozen=True)
class TokenEvent:
    """Engine output on `tokens.<request_id>`: the generated tokens at output position `index`.

    Prefill sends index 0 (the first token) and decode sends the rest, on different connections: the
    consumer reorders by `index`. The final event carries `finish_reason` (or `error`).
    """

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    error_status: int = 0


@dataclass(frozen=True)
class Cancel:
    """Broadcast on `requests.cancel`: every hop frees what it holds for the request. With `worker_id`, only that
    worker lets go: the request lives on elsewhere (re-routed away from it), everyone else keeps it."""

    request_id: str
    reason: str = "cancelled"
    worker_id: str = ""
