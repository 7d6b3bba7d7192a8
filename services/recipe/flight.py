"""One request's output side, without I/O: engine TokenEvents in (any order), API events out.

    TokenEvent(index, ids, finish) --reorder by index--> OutputProcessor (detokenize, parse, emit) --> Output

The first event carries the prompt usage (-> Ready), every event's ids go in order (-> Tokens), the engine's
finish ends the turn (-> End). A stop sequence or an end-of-sentence token can end it first: then the workers
must be told to cancel. A mesh error becomes an error response in the API's format, and a cancel too.

Exact migration: the flight keeps every engine token it took in order, so when the worker holding the request is
lost (the balancer's "lost" event) it can say how to resume: the original request with those tokens after the
prompt, at that output offset, as its next migration (`resume`). The sampler draws by (seed, output position),
so the continuation makes the tokens the lost worker would have; any it sends again are dropped by index. Events
of a migration the request has moved past may still come (a lost worker that was only silent): their tokens are
the same ones, but their ends (an error, an abort) are not the request's and are ignored. After
`max_migrations` resumptions a loss ends the request with the event's 503, as any error does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from services.recipe.emit.processor import End, OutputProcessor, Ready, Tokens
from services.recipe.errors import error_for
from services.recipe.prepared import PreparedRequest
from shared.api_errors import sse_error_frame
from shared.schemas.generate import LOST, GenerateRequest, TokenEvent

ENGINE_FINISH = ("stop", "length")


@dataclass
class Output:
    """What to publish after one event: an ApiEvent (frames, or the final body) and maybe a Cancel."""

    frames: list[bytes] = field(default_factory=list)
    done: bool = False
    status: int = 200
    body: bytes = b""
    cancel: str = ""  # a Cancel reason for the workers, "" = none
    resume: bool = False  # the worker was lost: submit `Flight.resume()` (nothing goes to the client)


class Flight:
    def __init__(self, request_id: str, prepared: PreparedRequest, processor: OutputProcessor, now: float,
                 request: GenerateRequest | None = None, max_migrations: int = 0, epoch: int = 0) -> None:
        """`request`: what was submitted, which a continuation extends (None: the request cannot resume).
        `epoch`: how many recipes this request lost before this one took it over (ApiEvent.epoch)."""
        self.request_id = request_id
        self.prepared = prepared
        self.request = request
        self.epoch = epoch
        self.migration = 0  # of the run now producing the request's tokens (GenerateRequest.migration)
        self._first_migration = 0  # this recipe's first (migrations are counted from it)
        self._max_migrations = max_migrations
        self._ids: list[int] = []  # the engine tokens taken in order: what a continuation starts from
        self._published = 0  # of them, those already carried by an ApiEvent (the gateway holds them)
        self.forked_at: int | None = None  # the first position a repeat disagreed with what the client has
        self.last_seen = now
        self.last_published = now  # when an ApiEvent last went to the gateway (the service keeps it fresh)
        self._processor = processor
        self._next = 0  # output position of the next token to feed
        self._taken = 0  # engine tokens fed so far
        self._pending: dict[int, TokenEvent] = {}
        self.cumulative_logprob = 0.0  # of the engine tokens taken (when they came with logprobs): best_of ranks by it
        self._ready = False
        self._seq = 0

    @property
    def done(self) -> bool:
        return self._processor.done

    def response(self) -> bytes:
        """The complete response JSON, once the request finished well (streamed or not)."""
        return self._processor.body()

    # metering for the gateway's /metrics (ApiEvent's fields)
    @property
    def output_tokens(self) -> int:
        """Engine tokens taken in order so far (those past a stop sequence included: they were generated)."""
        return self._taken

    @property
    def cached_tokens(self) -> int:
        return self._processor.usage.cached_tokens

    @property
    def processor(self) -> OutputProcessor:
        return self._processor

    @property
    def finish_reason(self) -> str:
        return self._processor.finish_reason or ""

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq - 1

    def unpublished(self) -> list[int]:
        """The engine tokens taken since the last call: what the next ApiEvent carries."""
        ids, self._published = self._ids[self._published :], len(self._ids)
        return ids

    def replay(self, token_ids: list[int], prompt_tokens: int, cached_tokens: int, migration: int) -> None:
        """Take over a request whose recipe died: feed the output side the tokens whose output the client has,
        dropping what it makes of them (sent already), so the next tokens' output follows on where the client's
        stream stopped; `migration`: the highest the lost recipe may have started (the continuation goes past)."""
        p = self._processor
        self._ready = True
        p.push(Ready(prompt_tokens, cached_tokens))
        if token_ids:
            p.push(Tokens(list(token_ids)))
        self._ids = list(token_ids)
        self._taken = self._next = self._published = len(token_ids)
        self.migration = self._first_migration = migration

    def on_event(self, ev: TokenEvent, now: float) -> Output | None:
        if self.done:
            return None
        self.last_seen = now
        ended = bool(ev.error) or ev.finish_reason not in (None, *ENGINE_FINISH)
        if ended and ev.migration < self.migration:
            return None  # the end of a run the request has moved past: not the request's end
        if ev.finish_reason == LOST:
            return self._lost(ev)
        if ended:
            # the request is over for the client: every hop still holding it (another worker, a redelivery) lets go
            return self.fail(ev.error_status or 503, ev.error or f"the request ended: {ev.finish_reason}", "error")
        if ev.index < self._next or ev.index in self._pending:
            self._check_repeat(ev)
            return None  # a duplicate (redelivered work, a re-routed prefill, a continuation): already seen
        self._pending[ev.index] = ev
        events = []
        engine_finished = consumed = False
        finished_by = self.migration
        p = self._processor
        while (nxt := self._pending.pop(self._next, None)) is not None and not p.done:
            consumed = True
            if not self._ready:
                self._ready = True
                events += p.push(Ready(nxt.prompt_tokens, nxt.cached_tokens))
            if nxt.token_ids:
                self._taken += len(nxt.token_ids)
                self._ids += nxt.token_ids
                self.cumulative_logprob += sum(lp.logprob for lp in nxt.logprobs)
                events += p.push(Tokens(nxt.token_ids, nxt.logprobs or None))
            self._next = nxt.index + max(len(nxt.token_ids), 1)
            if nxt.finish_reason is not None:
                engine_finished, finished_by = True, nxt.migration
                if not p.done:
                    events += p.push(End(nxt.finish_reason))  # type: ignore[arg-type]
        if not consumed:
            return None
        # The parser ended the turn before the engine did (a stop sequence, end-of-sentence): free the workers. So
        # too when a run the request moved past finished it (a lost worker that was only silent): the continuation
        # still runs.
        cancel = "stop" if p.done and not engine_finished else ""
        if p.done and engine_finished and finished_by < self.migration:
            cancel = "finished"
        if self.prepared.stream:
            return Output(p.frames(events), done=p.done, cancel=cancel)
        return Output(done=p.done, body=p.body() if p.done else b"", cancel=cancel)

    def _check_repeat(self, ev: TokenEvent) -> None:
        """A repeat must carry the tokens the client has: a different one means a run (a re-routed prefill, a
        continuation) sampled differently from the one it repeats (non-deterministic kernels). The client keeps
        the first; the position is noted so the service can say so."""
        taken = self._ids[ev.index : ev.index + len(ev.token_ids)]
        pending = self._pending.get(ev.index)
        seen = taken if ev.index < self._next else (pending.token_ids if pending is not None else [])
        if self.forked_at is None and list(ev.token_ids[: len(seen)]) != list(seen):
            self.forked_at = ev.index

    def _lost(self, ev: TokenEvent) -> Output:
        message = ev.error or "worker lost"
        if self.request is None or self.request.sampling.max_tokens <= len(self._ids):
            return self.fail(ev.error_status or 503, message, "error")
        if self.migration - self._first_migration >= self._max_migrations:
            if self._max_migrations:
                message += f" (the request was resumed {self.migration - self._first_migration} times already)"
            return self.fail(ev.error_status or 503, message, "error")
        return Output(resume=True)

    def resume(self, arrival: float) -> GenerateRequest:
        """The continuation to submit after a "lost" event: the prompt and every token taken so far, generation
        going on at the next output position, as the request's next migration. `arrival`: unix time now."""
        assert self.request is not None and not self.done
        self.migration += 1
        return dataclasses.replace(
            self.request, prompt_ids=[*self.request.prompt_ids, *self._ids], output_offset=len(self._ids),
            migration=self.migration, arrival=arrival,
        )

    def fail(self, status: int, message: str, cancel: str = "") -> Output:
        """End with an error; the gateway writes it as the API's error response (or last SSE frame)."""
        self._processor.done = True
        error = error_for(self.prepared.api, status, message)
        named = self.prepared.api in ("messages", "responses")
        frames = [sse_error_frame(error.body, named=named)] if self.prepared.stream else []
        return Output(frames, done=True, status=error.status, body=error.body, cancel=cancel)

