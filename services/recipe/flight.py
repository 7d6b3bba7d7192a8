"""One request's output side, without I/O: engine TokenEvents in (any order), API events out.

    TokenEvent(index, ids, finish) --reorder by index--> OutputProcessor (detokenize, parse, emit) --> Output

The first event carries the prompt usage (-> Ready), every event's ids go in order (-> Tokens), the engine's
finish ends the turn (-> End). A stop sequence or an end-of-sentence token can end it first: then the workers
must be told to cancel. A mesh error becomes an error response in the API's format, and a cancel too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.recipe.emit.processor import End, OutputProcessor, Ready, Tokens
from services.recipe.errors import error_for
from services.recipe.prepared import PreparedRequest
from shared.api_errors import sse_error_frame
from shared.schemas.generate import TokenEvent

ENGINE_FINISH = ("stop", "length")


@dataclass
class Output:
    """What to publish after one event: an ApiEvent (frames, or the final body) and maybe a Cancel."""

    frames: list[bytes] = field(default_factory=list)
    done: bool = False
    status: int = 200
    body: bytes = b""
    cancel: str = ""  # a Cancel reason for the workers, "" = none


class Flight:
    def __init__(self, request_id: str, prepared: PreparedRequest, processor: OutputProcessor, now: float) -> None:
        self.request_id = request_id
        self.prepared = prepared
        self.last_seen = now
        self.last_published = now  # when an ApiEvent last went to the gateway (the service keeps it fresh)
        self._processor = processor
        self._next = 0  # output position of the next token to feed
        self._taken = 0  # engine tokens fed so far
        self._pending: dict[int, TokenEvent] = {}
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
    def finish_reason(self) -> str:
        return self._processor.finish_reason or ""

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq - 1

    def on_event(self, ev: TokenEvent, now: float) -> Output | None:
        if self.done:
            return None
        self.last_seen = now
        if ev.error or ev.finish_reason not in (None, *ENGINE_FINISH):
            # the request is over for the client: every hop still holding it (another worker, a redelivery) lets go
            return self.fail(ev.error_status or 503, ev.error or f"the request ended: {ev.finish_reason}", "error")
        if ev.index < self._next or ev.index in self._pending:
            return None  # a duplicate (redelivered work): already seen
        self._pending[ev.index] = ev
        events = []
        engine_finished = consumed = False
        p = self._processor
        while (nxt := self._pending.pop(self._next, None)) is not None and not p.done:
            consumed = True
            if not self._ready:
                self._ready = True
                events += p.push(Ready(nxt.prompt_tokens, nxt.cached_tokens))
            if nxt.token_ids:
                self._taken += len(nxt.token_ids)
                events += p.push(Tokens(nxt.token_ids))
            self._next = nxt.index + max(len(nxt.token_ids), 1)
            if nxt.finish_reason is not None:
                engine_finished = True
                if not p.done:
                    events += p.push(End(nxt.finish_reason))  # type: ignore[arg-type]
        if not consumed:
            return None
        # The parser ended the turn before the engine did (a stop sequence, end-of-sentence): free the workers.
        cancel = "stop" if p.done and not engine_finished else ""
        if self.prepared.stream:
            return Output(p.frames(events), done=p.done, cancel=cancel)
        return Output(done=p.done, body=p.body() if p.done else b"", cancel=cancel)

    def fail(self, status: int, message: str, cancel: str = "") -> Output:
        """End with an error; the gateway writes it as the API's error response (or last SSE frame)."""
        self._processor.done = True
        error = error_for(self.prepared.api, status, message)
        named = self.prepared.api in ("messages", "responses")
        frames = [sse_error_frame(error.body, named=named)] if self.prepared.stream else []
        return Output(frames, done=True, status=error.status, body=error.body, cancel=cancel)

