"""Admission control: a bounded queue per model, decided before anything is submitted to the mesh.

    prepare() --validated, sized--> Ledger.check(model, prompt tokens) --None--> enter() -> submit
                                                                       --Refusal--> 429 + Retry-After

Why here, in the recipe, and not in the balancer: the recipe is the last hop that can still refuse a request
with nothing queued (the balancer only sees a job once it is in the JetStream work queue, too late to send the
client a 429 without having queued work), and it knows its own load exactly and at once: every request it
launched and has not yet ended, by model, with its prompt size (the balancer's view comes from heartbeats that
lag). The cost is a dict lookup. With several recipe replicas each bounds its own share (the gateway spreads
requests over them through the queue group), so the mesh's bound is the limit times the replicas.

"Queued" counts every request in flight (waiting for a worker or running): a request holds KV and a place in
the workers' queues for as long as it lives, so that is what bounds TTFT for the next one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60
LIFETIME_WEIGHT = 0.2  # each finished request moves the lifetime estimate this far towards its own lifetime


@dataclass(frozen=True)
class AdmissionLimits:
    """Per model, per recipe: requests in flight and their prompt tokens. 0 = unbounded."""

    max_requests: int = 0
    max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_requests < 0 or self.max_tokens < 0:
            raise ValueError(f"admission limits must be 0 (unbounded) or positive, got {self}")


@dataclass(frozen=True)
class Load:
    """One model's requests in flight, and `lifetime_s`: how long a request lives, on recent average (0 =
    none finished yet)."""

    requests: int = 0
    tokens: int = 0
    lifetime_s: float = 0.0


@dataclass(frozen=True)
class Refusal:
    limit: str  # "requests" | "tokens": OpenAI's rate-limit error `type` names which limit was hit
    message: str
    retry_after_s: int


def decide(load: Load, prompt_tokens: int, limits: AdmissionLimits) -> Refusal | None:
    """None admits. An idle model admits any request that passed the context checks, so a prompt longer than
    the token bound is served alone rather than refused forever."""
    if load.requests == 0:
        return None
    if limits.max_requests and load.requests >= limits.max_requests:
        excess = load.requests - limits.max_requests + 1
        return Refusal("requests", f"too many requests in flight for this model ({load.requests}, the limit is "
                       f"{limits.max_requests}); retry later", retry_after(load, excess))
    if limits.max_tokens and load.tokens + prompt_tokens > limits.max_tokens:
        # requests finish at about the same rate whatever their size: free enough of the average size
        average = load.tokens / load.requests
        excess = math.ceil((load.tokens + prompt_tokens - limits.max_tokens) / max(average, 1.0))
        return Refusal("tokens", f"too many prompt tokens in flight for this model ({load.tokens} + "
                       f"{prompt_tokens}, the limit is {limits.max_tokens}); retry later", retry_after(load, excess))
    return None


def retry_after(load: Load, excess: int) -> int:
    """Seconds until `excess` requests have likely finished: with `requests` in flight, each living
    `lifetime_s`, one ends every lifetime_s / requests seconds. Rounded up, within [1, 60]."""
    if load.lifetime_s <= 0:
        return RETRY_AFTER_MIN_S
    seconds = math.ceil(load.lifetime_s * excess / max(load.requests, 1))
    return max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, seconds))


@dataclass
class _ModelLoad:
    requests: int = 0
    tokens: int = 0
    lifetime_s: float = 0.0


@dataclass
class _Entry:
    model: str
    tokens: int
    since: float


@dataclass
class Ledger:
    """What this recipe has in flight, per model; no I/O. Every `enter` is matched by a `leave` (the service
    calls it where a request's state ends), and `leave` of an unknown id does nothing."""

    limits: AdmissionLimits
    _models: dict[str, _ModelLoad] = field(default_factory=dict)
    _entries: dict[str, _Entry] = field(default_factory=dict)

    def load(self, model: str) -> Load:
        m = self._models.get(model, _ModelLoad())
        return Load(m.requests, m.tokens, m.lifetime_s)

    def check(self, model: str, prompt_tokens: int) -> Refusal | None:
        return decide(self.load(model), prompt_tokens, self.limits)

    def enter(self, request_id: str, model: str, prompt_tokens: int, now: float) -> None:
        assert request_id not in self._entries, request_id
        self._entries[request_id] = _Entry(model, prompt_tokens, now)
        m = self._models.setdefault(model, _ModelLoad())
        m.requests += 1
        m.tokens += prompt_tokens

    def leave(self, request_id: str, now: float) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        m = self._models[entry.model]
        m.requests -= 1
        m.tokens -= entry.tokens
        lived = max(now - entry.since, 0.0)
        m.lifetime_s = lived if m.lifetime_s == 0 else m.lifetime_s + LIFETIME_WEIGHT * (lived - m.lifetime_s)
