"""One request inside the engine: its tokens, how many have KV, its blocks and its sampling state."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from shared import hashing


class Status(Enum):
    WAITING = auto()  # not admitted yet, or preempted (its KV dropped, to be recomputed)
    RUNNING = auto()
    HELD = auto()  # finished with hold_kv: blocks kept until release()


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters validated and resolved at add(): the seed is always set."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # output positions below this one cannot sample a stop id
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) sorted by id: hashable, as a frozen spec is
    logprobs: int = -1  # -1 = off; n >= 0: the sampled token's raw logprob and the n most likely ids'
    reasoning_budget: int = -1  # -1 = off; else positions from it on are forced to reasoning_end until it occurs
    reasoning_end: int = -1

    @property
    def counts_output(self) -> bool:
        """Whether a penalty or the reasoning budget reads how often each token occurs in the output (processors.py
        keeps the counts: the budget asks whether reasoning_end is among them)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.reasoning_budget >= 0

    @property
    def processed(self) -> bool:
        """Whether the logits processors before the sampler (processors.py) have anything to do for it."""
        return (self.repetition_penalty != 1.0 or self.min_tokens > 0 or self.counts_output
                or bool(self.logit_bias))


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt + generated; only [0, num_computed) have KV
    sampling: SamplingSpec
    stop_ids: frozenset[int]
    max_new_tokens: int  # already clamped to context and KV capacity
    output_offset: int  # output position of the next token we generate
    hold_kv: bool
    ns: bytes = b""  # namespace of its blocks' chained hashes: the engine's cache identity + the request's salt
    prefix_blobs: list[bytes] = field(default_factory=list)  # to import at admission, then dropped
    prefix_tokens: int = 0
    status: Status = Status.WAITING
    num_computed: int = 0
    num_generated: int = 0
    num_cached: int | None = None  # prompt tokens whose KV was not computed here; set at first admission
    block_table: list[int] = field(default_factory=list)
    num_published: int = 0  # leading blocks offered to the local prefix cache
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks, extended lazily
    drafts: list[int] = field(default_factory=list)  # speculative tokens proposed after the last one

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens still to compute before the next token can be sampled (1 when decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def output_position(self) -> int:
        return self.output_offset + self.num_generated

    def block_hashes(self, ns: bytes, num_blocks: int, bt: int = hashing.BLOCK_TOKENS) -> list[bytes]:
        """Chained hashes of the first `num_blocks` full blocks of `bt` tokens (cached between calls: the chain
        only grows; one engine always asks with the same block size)."""
        while len(self.hashes) < num_blocks:
            i = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else ns
            # block_hashes() starts its chain at `ns`, so a one-block call with the parent continues the chain.
            (h,) = hashing.block_hashes(self.token_ids[i * bt : (i + 1) * bt], parent, bt)
            self.hashes.append(h)
        return self.hashes[:num_blocks]
