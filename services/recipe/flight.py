"""One request in flight on the output side: TokenEvents in (any order), API output out. Pure: no I/O.

Prefill sends output position 0 and decode the rest, over different connections, so events can arrive out of
order. They are buffered by `index` and consumed in order:

    next = 5 | pending {7: [t7, t8], 9: [t9]}   <- [t5, t6] arrives at index 5: consume 5, 7, 9 -> next = 10

Each token is detokenized (UTF-8 safe), run through the stop-string matcher, and formatted by the API's
writer. The flight ends on EOS / a stop token, a stop string, max_tokens, the engine's finish, or an error;
when it ends before the engine knows (stop string, EOS seen first), its output asks for a Cancel so the
workers free the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.recipe.apis import Api, ApiError, ChatRequest, Finish, ResponseWriter, Usage
from services.recipe.detokenize import IncrementalDetokenizer
from services.recipe.stops import StopMatcher
from shared.schemas.generate import TokenEvent
from shared.tokenizer import Tokenizer

_ENGINE_FINISH = {"stop": "stop", "length": "length"}  # engine finish_reason -> neutral Finish.reason


@dataclass
class Output:
    """What to publish for the request after one event: an ApiEvent (when it has frames or is done) and maybe
    a Cancel for the workers."""

    frames: list[bytes] = field(default_factory=list)
    done: bool = False
    status: int = 200
    body: bytes = b""
    cancel: str = ""  # a Cancel reason to broadcast, "" = none


class Flight:
    def __init__(
        self,
        request_id: str,
        api: Api,
        req: ChatRequest,
        writer: ResponseWriter,
        tokenizer: Tokenizer,
        *,
        prompt_tokens: int,
        max_tokens: int,
        stop_ids: frozenset[int],
        now: float,
    ) -> None:
        self.request_id = request_id
        self.api = api
        self.last_seen = now
        self.last_published = now  # when an ApiEvent last went to the gateway (the service keeps it fresh)
        self.done = False
        self._stream = req.stream
        self._writer = writer
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopMatcher(req.stop)
        self._stop_ids = stop_ids
        self._max_tokens = max_tokens
        self._prompt_tokens = prompt_tokens
        self._cached_tokens = 0
        self._completion_tokens = 0
        self._text: list[str] = []  # non-streaming: the whole answer, joined at the end
        self._next = 0  # output position of the next token to consume
        self._pending: dict[int, TokenEvent] = {}
        self._end: TokenEvent | None = None  # a token-less final event, applied once `_next` reaches its index
        self._started = False  # streaming: the API's opening frames are out
        self._seq = 0

    @property
    def usage(self) -> Usage:
        return Usage(self._prompt_tokens, self._completion_tokens, self._cached_tokens)

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq - 1

    # --- input ---------------------------------------------------------------------------------------------

    def on_event(self, ev: TokenEvent, now: float) -> Output | None:
        if self.done:
            return None
        self.last_seen = now
        if ev.error or ev.finish_reason not in (None, *_ENGINE_FINISH):
            status = ev.error_status or 503
            return self.fail(self.api.error(status, ev.error or f"the request ended: {ev.finish_reason}"))
        if ev.index < self._next:
            return None  # a duplicate (redelivered work): already consumed
        if ev.token_ids:
            self._pending[ev.index] = ev
        elif ev.finish_reason is not None:
            self._end = ev
        if ev.prompt_tokens:  # the engine's count is the truth about what it computed and what it reused
            self._prompt_tokens, self._cached_tokens = ev.prompt_tokens, ev.cached_tokens
        return self._advance()

    def fail(self, error: ApiError, cancel: str = "") -> Output:
        """End the request with an error in the API's format (status + body; frames when streaming)."""
        self.done = True
        frames = self._writer.error_frames(error) if self._stream else []
        return Output(frames, done=True, status=error.status, body=error.body, cancel=cancel)

    # --- in-order processing -------------------------------------------------------------------------------

    def _advance(self) -> Output | None:
        pieces: list[str] = []
        finish: Finish | None = None
        engine_done = False
        consumed = False
        while finish is None and (ev := self._pending.pop(self._next, None)) is not None:
            consumed = True
            self._next = ev.index + len(ev.token_ids)
            finish = self._consume(ev.token_ids, pieces)
            engine_done = ev.finish_reason is not None
            if finish is None and ev.finish_reason is not None:
                finish = Finish(_ENGINE_FINISH[ev.finish_reason])
        if finish is None and self._end is not None and self._next >= self._end.index:
            finish, engine_done = Finish(_ENGINE_FINISH[self._end.finish_reason or "stop"]), True
        if finish is not None and finish.reason != "stop_string":
            pieces.append(self._stops.feed(self._detok.flush()) + self._stops.flush())
        start = not self._started and (consumed or finish is not None)
        self._started |= start
        if not pieces and not start and finish is None:
            return None
        return self._output("".join(pieces), start, finish, cancel=finish is not None and not engine_done)

    def _consume(self, token_ids: list[int], pieces: list[str]) -> Finish | None:
        for tid in token_ids:
            self._completion_tokens += 1
            if tid in self._stop_ids:
                return Finish("stop")  # EOS is not rendered as text
            pieces.append(self._stops.feed(self._detok.feed(tid)))
            if self._stops.hit is not None:
                return Finish("stop_string", self._stops.hit)
            if self._completion_tokens >= self._max_tokens:
                return Finish("length")
        return None

    def _output(self, text: str, start: bool, finish: Finish | None, cancel: bool) -> Output:
        out = Output(cancel="stop" if cancel else "")
        if self._stream:
            if start:
                out.frames += self._writer.start(self.usage)
            out.frames += self._writer.delta(text)
            if finish is not None:
                out.frames += self._writer.finish(finish, self.usage)
        else:
            self._text.append(text)
            if finish is not None:
                out.body = self._writer.body("".join(self._text), finish, self.usage)
        out.done = finish is not None
        self.done = out.done
        return out
