"""Several choices for one request (Chat and Completions `n > 1`, Completions `best_of`), without I/O: the request
fans out into sub-requests, one ordinary mesh request each, and their outputs merge back into one response.

    client request rid --> sub-requests choice_id(rid, 0..k-1), k = best_of (= n without it), seeds choice_seed
    each sub-request: its own Flight (reorder, detokenize, migration), its emitter writing choice i
    FanOut.take(i, output) --> one Output for the client's request

Streaming (n only: best_of refuses it): every choice's chunks pass on as they come, each carrying its index; once
every choice is done, the request's usage (prompt tokens once, completion tokens summed) and `[DONE]`.
Non-streaming: one response with every choice (best_of: the n with the highest cumulative logprob, in that
order), the usage summed over every candidate generated. A choice that fails fails the response with its error.

The prompt's KV is shared through the prefix cache: choice 0 goes first and the others are submitted once its
first token is back (`FanOut.unsent`), when prefill has computed the prompt, so they prefill only what the cache
does not hold (the prompt's last partial block).
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass, field

import orjson

from services.recipe.emit.base import Usage
from services.recipe.flight import Flight, Output
from services.recipe.prepared import PreparedRequest
from shared.schemas.generate import GenerateRequest


def choice_id(request_id: str, index: int) -> str:
    """The mesh request id of choice `index` of `request_id` (its subjects, cancels, logs)."""
    return f"{request_id}-c{index}"


def choice_seed(seed: int, index: int) -> int:
    """Choice 0 samples with the request's seed (so it is the n = 1 answer); choice i > 0 with a 63-bit seed derived
    from (seed, i): reproducible with a client seed, independent without (the recipe drew `seed`)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(struct.pack("<QQ", seed % 2**64, index), digest_size=8, person=b"choice").digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class FanOut:
    request_id: str
    prepared: PreparedRequest
    flights: list[Flight] = field(default_factory=list)  # one per candidate, in choice order
    unsent: list[GenerateRequest] = field(default_factory=list)  # submitted once choice 0's first token is back
    last_published: float = field(default_factory=time.monotonic)
    done: bool = False
    _finished: set[int] = field(default_factory=set)
    _seq: int = 0

    @property
    def n(self) -> int:
        return self.prepared.inference.n

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq - 1

    def index(self, flight: Flight) -> int:
        return next(i for i, f in enumerate(self.flights) if f is flight)

    def take(self, flight: Flight, out: Output) -> Output | None:
        """One choice's output -> the request's (None once the request is over)."""
        if self.done:
            return None
        if out.status != 200:  # its error (in the API's format, a stream's last frame) is the request's
            self.done = True
            return Output(out.frames, done=True, status=out.status, body=out.body)
        if out.done:
            self._finished.add(self.index(flight))
        if len(self._finished) < len(self.flights):
            return Output(list(out.frames))
        self.done = True
        if self.prepared.stream:
            return Output([*out.frames, *self.flights[0].processor.closing_frames(self.usage())], done=True)
        return Output(done=True, body=self.body())

    def usage(self) -> Usage:
        """The request's: its prompt once (cached: what the first choice found, before its siblings' reuse),
        every candidate's completion and reasoning tokens."""
        first = self.flights[0].processor.usage
        done = [f.processor.usage for f in self.flights]
        return Usage(first.prompt_tokens, first.cached_tokens, sum(u.completion_tokens for u in done),
                     sum(u.reasoning_tokens for u in done))

    def chosen(self) -> list[Flight]:
        """best_of: the n candidates of highest cumulative logprob, best first (ties: lower index); else all."""
        if len(self.flights) == self.n:
            return list(self.flights)
        return sorted(self.flights, key=lambda f: -f.cumulative_logprob)[: self.n]

    def body(self) -> bytes:
        """The merged response: the chosen choices re-indexed 0..n-1 in the first one's envelope."""
        bodies = [orjson.loads(f.response()) for f in self.chosen()]
        merged = bodies[0]
        merged["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
        merged["usage"] = self.flights[0].processor.usage_object(self.usage())
        return orjson.dumps(merged)

    @property
    def output_tokens(self) -> int:
        return sum(f.output_tokens for f in self.flights)

    @property
    def finish_reason(self) -> str:
        return self.chosen()[0].finish_reason if self.done else ""
