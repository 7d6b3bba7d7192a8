"""The request as the engine sees it: token ids and sampling, produced by the recipe."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "structural_tag"]


@dataclass(frozen=True)
class Constraint:
    """What the output must match (grammar-constrained decoding, shared/engine/grammar.py): a JSON schema, any JSON
    object (OpenAI's JSON mode), a regex, an EBNF grammar (xgrammar's dialect, as vLLM's `grammar`), or an xgrammar
    structural tag (JSON: a tool call's markup and arguments, services/recipe/formats/dsml_grammar.py; a part of it
    may carry {"tool": name}, which xgrammar ignores, so a compile error can name the tool).

    With `after_token` >= 0 the output is free until that token is generated (the end-of-thinking marker of a
    reasoning model) and matches `spec` from the next token on: the reasoning itself is never constrained."""

    kind: ConstraintKind
    spec: str = ""  # the compact JSON schema, the regex, the grammar or the structural tag; "" for json_object
    after_token: int = -1  # -1 = constrained from the first output token


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top one's; 0 = off
    repetition_penalty: float = 1.0  # vLLM's / HF's: logits of tokens seen in prompt or output /(>0) or x(<0); 1 = off
    min_tokens: int = 0  # stop ids (EOS included) are masked until this many tokens were generated
    # OpenAI's: logit - frequency_penalty x count - presence_penalty x (count > 0), over the output tokens only
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    # None = off; n: each sampled token's logprob and the n most likely ids' (vLLM's default "raw_logprobs": the
    # model's own distribution, before bias, penalties and temperature), n in [0, MAX_LOGPROBS]
    logprobs: int | None = None
    seed: int | None = None  # None = nondeterministic
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # the model's EOS ids do not end the sequence (stop_token_ids still do)
    # the output must match it; it travels with the request (prefill job, decode job, a continuation), and every
    # engine rebuilds its state from the output so far
    constraint: Constraint | None = None
    # the reasoning budget (Anthropic's thinking.budget_tokens): while `reasoning_end` (the format's one
    # end-of-thinking token) has not been generated, output position reasoning_budget and every one after it can
    # only be that token, so at most reasoning_budget reasoning tokens come before the answer. -1 = no budget.
    # Positions count from the output's start (across the hand-over and a migration, as min_tokens does).
    reasoning_budget: int = -1
    reasoning_end: int = -1


MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability and the `logprobs` most likely ids' at its position (most likely
    first), under the model's raw distribution."""

    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt (V4.1): the run of prompt ids its tokens take and what an encoder needs to fill it.

    prompt_ids  ... <｜User｜> q  [IMG IMG IMG ... IMG]  <｜Assistant｜> ...
                                  ^ start     length = the image's V4.1 token count (its grid, row ends, frame)

    `data` is the image as the client sent it (PNG, JPEG, GIF or WebP: the recipe holds no image library, so
    decoding and resizing to width x height are the encoder's), `digest` the sha256 of those bytes and the size:
    the content hash that block hashes and an embedding cache key on."""

    digest: bytes
    start: int
    length: int
    data: bytes
    format: str  # "png" | "jpeg" | "gif" | "webp"
    width: int  # after preprocessing (the V4.1 size, whole 14-px patches)
    height: int
    detail: str = "high"  # "low" | "high" | "original" | "auto"


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    cache_salt: str = ""  # tenant salt for block hashes
    arrival: float = 0.0  # unix time at the gateway
    # A continuation (exact migration): the request resumed after the worker holding it was lost. Its last
    # `output_offset` prompt ids are its own output, already streamed; generation goes on at that output
    # position with the same sampling (the sampler draws by (seed, position), so the tokens are the ones the lost
    # worker would have made). `migration` counts the resumptions (0 = the original), so each one has its own
    # message ids and a worker tells a redelivered older job from a new one.
    output_offset: int = 0
    migration: int = 0
    images: list[ImageInput] = field(default_factory=list)  # in prompt order; their spans hold image tokens

    @property
    def remaining_tokens(self) -> int:
        """How many tokens the request may still generate."""
        return self.sampling.max_tokens - self.output_offset


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
    first_logprobs: list[TokenLogprob] = field(default_factory=list)  # first_token's, when the request asked


@dataclass(frozen=True)
class TokenEvent:
    """Engine output on `tokens.<request_id>`: the generated tokens at output position `index`.

    Prefill sends index 0 (the first token) and decode sends the rest, on different connections: the
    consumer reorders by `index`. The final event carries `finish_reason` (or `error`).
    """

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "lost" (below)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    error_status: int = 0
    migration: int = 0  # the request's migration that sent it (GenerateRequest.migration)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids entry when the request asked


# The balancer's TokenEvent when the worker holding a request is gone with its state: the output streamed so far
# stands and the request may resume from it (a continuation, GenerateRequest.output_offset). It also carries an
# `error` and a 503, so a consumer that does not resume ends the request as it would on any error.
LOST = "lost"


EVERY_WORKER = "*"  # Cancel.worker_id: every worker, up to Cancel.migration


@dataclass(frozen=True)
class Cancel:
    """Broadcast on `requests.cancel`: every hop frees what it holds for the request. With `worker_id`, only that
    worker lets go, and only of the request's migrations up to `migration`: the request lives on elsewhere
    (re-routed or resumed away from it), and a later continuation may still come to that worker. `role`: the role
    `worker_id` had in the request (the balancer's, for a worker it took for lost), so the other role lets go of
    what it held for that worker (prefill: the KV hand-over a lost decode worker was to pull). `worker_id` ==
    EVERY_WORKER: every worker lets go of those migrations (a recipe that takes over a request whose recipe died
    ends the runs the dead one left, before its continuation); the request itself lives on."""

    request_id: str
    reason: str = "cancelled"
    worker_id: str = ""
    migration: int = 0
    role: str = ""
