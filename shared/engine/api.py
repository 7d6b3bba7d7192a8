"""The engine's public request/result types: what the prefill and decode services code against."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.schemas.generate import SamplingParams, TokenLogprob


class RequestError(ValueError):
    """A request the engine refuses because of what the client asked (sampling out of range, too long): the
    worker answers it as a 4xx; any other ValueError from the engine is a bug on the caller's side."""


class EngineFailure(RuntimeError):
    """A step the request was in failed (a kernel error, out of device memory): the engine dropped every request
    of that step. The worker answers the client with a 500 at once rather than let it wait for a timeout."""


@dataclass
class EngineRequest:
    request_id: str
    token_ids: list[int]  # all tokens so far (prompt, plus any already-generated tokens)
    sampling: SamplingParams  # max_tokens there is ignored here
    max_new_tokens: int  # how many tokens this engine may still generate
    output_offset: int = 0  # output position of the next generated token (for seeded sampling)
    # KV of tokens [0, prefix_tokens), one blob per block; b"" = a block this engine already holds (cached_blocks)
    prefix_blocks: list[bytes] = field(default_factory=list)
    prefix_tokens: int = 0
    prefix_state: bytes = b""  # per-request model state after prefix_tokens (V4), b"" = rebuild it (replay)
    hold_kv: bool = False  # when finished keep the blocks until release() (prefill exports them)
    stop_token_ids: list[int] | None = None  # None = model's eos ids + sampling.stop_token_ids (unless ignore_eos)
    cache_salt: str = ""  # tenant (+ request) salt: the local prefix cache is shared only within one salt


@dataclass
class StepOutput:
    request_id: str
    token_ids: list[int]  # newly generated this step (usually 1; 0 while a prompt is still being chunk-prefilled)
    finish_reason: str | None  # "stop" (eos/stop token) | "length" | None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from prefix_blocks or the local prefix cache
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry when the request asked for them


@dataclass(frozen=True)
class KvLayout:
    """What a worker needs to know of an engine's KV to move it: fixed once the engine is built."""

    block_tokens: int
    block_bytes: int  # one block's bytes, every layer
    cache_id: str  # names the model, dtype and layout: blocks of different ids never mix
    has_request_state: bool  # per-request state (DeepSeek-V4's rings) travels with the blocks
    replay_tokens: int  # tokens recomputed before a prefix restored without that state
    device: str = "cpu"  # where the KV lies ("cuda:0"): a GPU's can be handed over by CUDA IPC


@dataclass(frozen=True)
class EngineStats:
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    queued_tokens: int  # tokens of admitted or waiting prompts whose KV is not computed yet
    held: int = 0  # finished hold_kv requests still holding blocks
    drafted: int = 0  # speculative drafts proposed so far (any drafter)
    accepted: int = 0  # ... and accepted: the acceptance rate is accepted / drafted
    verifies: int = 0  # decode chunks that verified drafts: mean accepted length is 1 + accepted / verifies
