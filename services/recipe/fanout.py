"""Several choices for one request (Chat and Completions `n > 1`, Completions `best_of`): the request fans out into
sub-requests, one ordinary mesh request each, and their outputs merge back into one response. `FanOut` is one
request's merging, without I/O; `FanOuts` is the recipe's fan-outs and their I/O (submitting, publishing,
cancelling), on the service's bus and flights (`Host`: services/recipe/service.py is the one).

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

import dataclasses
import hashlib
import logging
import struct
import time
from dataclasses import dataclass, field
from typing import Protocol

import orjson

from services.recipe.emit.base import Usage
from services.recipe.emit.processor import OutputProcessor
from services.recipe.errors import ApiError, error_for
from services.recipe.flight import Flight, Output
from services.recipe.model import ServedModel
from services.recipe.prepared import PreparedRequest
from shared import subjects
from shared.bus import Bus
from shared.schemas.gateway import ApiEvent, PrepareReply, PrepareRequest
from shared.schemas.generate import Cancel, GenerateRequest, SamplingParams

log = logging.getLogger(__name__)

KEEPALIVE_S = 10.0  # as the service's: an empty event now and then tells the gateway a long request is alive
UNAVAILABLE = "the model is not available right now, try again"


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


class Host(Protocol):
    """What the fan-outs need of the recipe service: its bus and its per-request state."""

    @property
    def bus(self) -> Bus: ...

    @property
    def boot(self) -> str: ...

    @property
    def max_migrations(self) -> int: ...

    async def track(self, flight: Flight, model: str, prompt_tokens: int) -> None:
        """Hold a candidate like any request: its flight, its admission place, its token subscription."""

    def drop(self, request_id: str) -> bool:
        """End a candidate's state (True if it was held)."""

    async def emit(self, flight: Flight, out: Output) -> None:
        """A candidate's output, as any flight's (it comes back to `FanOuts.emit` through the host)."""


class FanOuts:
    """The recipe's requests of several choices, by the client's request id and by each candidate's."""

    def __init__(self, host: Host) -> None:
        self._host = host
        self._by_request: dict[str, FanOut] = {}
        self._of_choice: dict[str, FanOut] = {}  # a candidate's request id -> its fan-out

    def get(self, request_id: str) -> FanOut | None:
        return self._by_request.get(request_id)

    def of_choice(self, request_id: str) -> FanOut | None:
        return self._of_choice.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_request

    async def launch(self, req: PrepareRequest, prepared: PreparedRequest, model: ServedModel, prompt_ids: list[int],
                     sampling: SamplingParams, salt: str, created: int, response_id: str) -> PrepareReply:
        """One sub-request per candidate, each an ordinary mesh request with its own Flight; choice 0 is submitted
        now, the others once its first token is back (they find the prompt's KV)."""
        host = self._host
        rid = req.request_id
        if req.resume is not None:  # the gateway holds one stream's tokens, not several
            return _refuse(error_for(prepared.api, 503, "a request with several choices cannot be resumed after "
                                                        "its recipe was lost; try again"))
        fan = FanOut(rid, prepared)
        logprobs = 0 if sampling.logprobs is None and prepared.inference.best_of > prepared.inference.n else None
        now = time.time()
        for i in range(prepared.inference.best_of):
            sub = choice_id(rid, i)
            sp = dataclasses.replace(sampling, seed=choice_seed(sampling.seed or 0, i),
                                     logprobs=sampling.logprobs if logprobs is None else logprobs)
            generate = GenerateRequest(sub, model.name, prompt_ids, sp, cache_salt=salt, arrival=now)
            processor = OutputProcessor(prepared, response_id=response_id, created=created,
                                        tokens=model.tokens, count_tokens=model.count_tokens, choice=i)
            flight = Flight(sub, prepared, processor, time.monotonic(), generate, host.max_migrations)
            fan.flights.append(flight)
            fan.unsent.append(generate)
            self._of_choice[sub] = fan
            await host.track(flight, model.name, len(prompt_ids))
        self._by_request[rid] = fan
        first = fan.unsent.pop(0)
        try:
            await host.bus.submit(subjects.ROUTE_PREFILL, first, msg_id=first.request_id)
        except Exception as exc:  # JetStream unavailable: nothing was queued, nothing to cancel
            log.warning("%s: submit failed: %s", rid, exc)
            self._end(fan)
            return _refuse(error_for(prepared.api, 503, UNAVAILABLE))
        if rid not in self._by_request:  # cancelled while being submitted: the workers must drop it too
            await host.bus.publish(subjects.CANCEL, Cancel(first.request_id, reason="cancelled"))
        log.info("%s %s model=%s prompt=%d: %d choices of %d candidates (%s-c0...), seed=%d stream=%s", rid,
                 prepared.api, model.name, len(prompt_ids), prepared.inference.n, prepared.inference.best_of, rid,
                 sampling.seed, prepared.stream)
        return PrepareReply(ok=True, stream=prepared.stream, prompt_tokens=len(prompt_ids), recipe=host.boot,
                            seed=sampling.seed or 0, created=created)

    async def on_progress(self, flight: Flight) -> None:
        """A candidate's tokens came: once choice 0's first is back its prompt is computed, and the other
        candidates are submitted to reuse its KV."""
        fan = self._of_choice.get(flight.request_id)
        if fan is None or not fan.unsent or flight.output_tokens == 0 or fan.done:
            return
        rest, fan.unsent = fan.unsent, []
        try:
            for generate in rest:
                await self._host.bus.submit(subjects.ROUTE_PREFILL, generate, msg_id=generate.request_id)
        except Exception as exc:  # JetStream unavailable: the response cannot be whole
            log.warning("%s: submitting its other choices failed: %s", fan.request_id, exc)
            first = fan.flights[0]
            await self._host.emit(first, first.fail(503, UNAVAILABLE, "error"))

    async def emit(self, fan: FanOut, flight: Flight, out: Output) -> None:
        """One candidate's output, merged into its request's (published on the request's own events subject)."""
        bus = self._host.bus
        sub = flight.request_id
        if out.done:
            self._host.drop(sub)
        if out.cancel:
            await bus.publish(subjects.CANCEL, Cancel(sub, reason=out.cancel))
        merged = fan.take(flight, out)
        if merged is None:
            return
        now = time.monotonic()
        if merged.frames or merged.done or now - fan.last_published > KEEPALIVE_S:
            fan.last_published = now
            event = ApiEvent(
                fan.request_id, fan.next_seq(), merged.frames, merged.done, merged.status, merged.body,
                output_tokens=fan.output_tokens, cached_tokens=fan.flights[0].cached_tokens,
                finish_reason=fan.finish_reason if merged.done and merged.status == 200 else "",
            )
            await bus.publish(subjects.events(fan.request_id), event)
        if merged.done:
            if merged.status == 200:  # what sharing the prompt saved: the later candidates' cached share of it
                log.info("%s: %d candidates done; prompt %d tokens, cached per candidate %s", fan.request_id,
                         len(fan.flights), fan.usage().prompt_tokens, [f.cached_tokens for f in fan.flights])
            await self.cancel(fan, "error" if merged.status != 200 else "finished")

    async def cancel(self, fan: FanOut, reason: str) -> None:
        """The request is over (done, failed, or the client went): every candidate still running lets go."""
        for sub in self._end(fan):
            await self._host.bus.publish(subjects.CANCEL, Cancel(sub, reason=reason))

    def _end(self, fan: FanOut) -> list[str]:
        """Drop a fan-out and its candidates' state; the ids of those that were submitted and still running."""
        self._by_request.pop(fan.request_id, None)
        unsent = {g.request_id for g in fan.unsent}
        fan.unsent = []
        live = []
        for flight in fan.flights:
            self._of_choice.pop(flight.request_id, None)
            if self._host.drop(flight.request_id) and flight.request_id not in unsent:
                live.append(flight.request_id)
        return live


def _refuse(error: ApiError) -> PrepareReply:
    return PrepareReply(ok=False, status=error.status, error_body=error.body)
