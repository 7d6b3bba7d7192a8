"""The per-request output driver, shaped like deepseek-recipe's StreamProcessor: `push(chunk)` and `finish()`
return the stream events to send; `body()` gives the complete response once done.

    Ready(prompt usage) -> Tokens(ids) | Text(text)* -> Finish(reason)  [-> finish()]

    chunk --TokenPieces (ids only)--> pieces --OutputParser--> neutral events --API emitter--> stream events

The turn ends on a Finish chunk, an end-of-sentence token (it is never text; it counts as a completion token
and ends the turn like Finish("stop"); with ignore_eos it is an ordinary token, as it is for the engine), a stop sequence (then `stopped` is set: the engine should be told to
cancel), or `finish()` without a Finish chunk (a plain "stop": deepseek-recipe reports "tool_calls" only on
the backend's Finish("stop")). Chunks after the end are ignored.

A request is fed either text or token ids: the first Text or Tokens chunk fixes the parser's mode (with ids,
added-vocabulary tokens are symbols that ordinary text cannot spell; see parse/stages.py).

Usage: `completion_tokens` counts the ids of the pieces parsed for DeepSeek formats (deepseek-recipe's way:
none after a stop sequence's piece, none still held in a broken character), every id for chat-template
models, a Text chunk's `token_count`, and the end-of-sentence id. `reasoning_tokens` is the token count of
the reasoning text, re-encoded (deepseek-recipe's definition), when a counter is given.

Logprobs: a Tokens chunk may carry one TokenLogprob per id; they follow the ids into pieces and ride on the
text events of their piece (emit/logprobs.py says which), handed to the emitter with each event. A request
without them takes none of that path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Union

from services.recipe.emit.base import DONE_FRAME, Emitter, Finish, FinishReason, StreamEvent, Usage, sse
from services.recipe.emit.chat import ChatEmitter
from services.recipe.emit.completions import CompletionsEmitter
from services.recipe.emit.logprobs import LogprobTrack
from services.recipe.emit.messages import MessagesEmitter
from services.recipe.emit.responses import ResponsesEmitter
from services.recipe.parse.detok import TokenPieces, TokenTable
from services.recipe.parse.stream import OutputParser
from services.recipe.prepared import PreparedRequest
from shared.schemas.generate import TokenLogprob


@dataclass(frozen=True)
class Ready:
    prompt_tokens: int
    cached_tokens: int = 0
    system_fingerprint: str | None = None


@dataclass(frozen=True)
class Tokens:
    token_ids: Sequence[int]
    logprobs: Sequence[TokenLogprob] | None = None  # one per id, when the request asked (emit/logprobs.py)


@dataclass(frozen=True)
class Text:
    text: str
    token_count: int = 0


@dataclass(frozen=True)
class End:
    reason: Literal["stop", "length", "content_filter"]


Chunk = Union[Ready, Tokens, Text, End]


def _chat(p: PreparedRequest, rid: str, created: int, thinking: bool, choice: int | None) -> Emitter:
    return ChatEmitter(rid, p.model, created, thinking=thinking, stream=p.stream, include_usage=p.include_usage,
                       reasoning_first=p.parsing.thinking_initial_stage != "content_continuation", choice=choice)


def _messages(p: PreparedRequest, rid: str, created: int, thinking: bool, choice: int | None) -> Emitter:
    return MessagesEmitter(rid, p.model, thinking=thinking, stream=p.stream, signature=p.extra.get("signature"))


def _responses(p: PreparedRequest, rid: str, created: int, thinking: bool, choice: int | None) -> Emitter:
    return ResponsesEmitter(rid, p.model, created, stream=p.stream, echo=p.echo,
                            namespaces=p.extra.get("namespace_tool_map"))


def _completions(p: PreparedRequest, rid: str, created: int, thinking: bool, choice: int | None) -> Emitter:
    return CompletionsEmitter(rid, p.model, created, stream=p.stream, include_usage=p.include_usage,
                              logprobs=p.inference.logprobs, choice=choice)


# (prepared, response id, created, thinking, choice: the index of one choice of several, None = the only one)
EMITTERS: dict[str, Callable[[PreparedRequest, str, int, bool, int | None], Emitter]] = {
    "chat": _chat, "messages": _messages, "responses": _responses, "completions": _completions,
}


class OutputProcessor:
    def __init__(
        self,
        prepared: PreparedRequest,
        *,
        response_id: str,
        created: int | None = None,
        tokens: TokenTable | None = None,
        count_tokens: Callable[[str], int] | None = None,
        choice: int | None = None,
    ) -> None:
        """`response_id`: the id the client sees (e.g. "chatcmpl-<rid>"; Responses items derive theirs from it).
        `tokens`: the model's token table, for Tokens chunks (None: Text chunks only). `count_tokens`: counts
        the reasoning tokens for the usage (len of the tokenizer's encode). `choice`: the output is choice
        `choice` of several (Chat and Completions n > 1: recipe/fanout.py merges them)."""
        plain = prepared.encoding == "chat_template" or prepared.api == "completions"
        self._thinking = not plain and prepared.parsing.thinking_initial_stage is not None
        self._spec, self._plain = prepared.parsing, plain
        # a chat-template model offered tools writes Hermes calls (formats/hermes.py)
        self._hermes = prepared.encoding == "chat_template" and prepared.api != "completions" and \
            prepared.parsing.parse_tool_calls
        self._parser = OutputParser(prepared.parsing, plain=plain, hermes=self._hermes)  # text mode until Tokens
        self._fed = False
        self._pieces = TokenPieces(tokens, skip_special=plain) if tokens is not None else None
        self._table = tokens
        self._as_ids = prepared.inference.return_tokens_as_token_ids
        self._track: LogprobTrack | None = None  # from the first Tokens chunk with logprobs
        # With ignore_eos the engine goes on past an end-of-sentence id, and so does the answer.
        self._eos = tokens.eos_ids if tokens is not None and not prepared.inference.ignore_eos else frozenset()
        self._count = count_tokens
        created = int(time.time()) if created is None else created
        self._emitter = EMITTERS[prepared.api](prepared, response_id, created, self._thinking, choice)
        self.usage = Usage()
        self._started = False
        self.done = False
        self.finish_reason: FinishReason | None = None

    @property
    def stopped(self) -> bool:
        """A stop sequence ended the answer before the engine knew: it should cancel the request."""
        return self._parser.stopped

    def push(self, chunk: Chunk) -> list[StreamEvent]:
        if self.done:
            return []
        out: list[StreamEvent] = []
        if isinstance(chunk, Ready):
            self.usage.prompt_tokens, self.usage.cached_tokens = chunk.prompt_tokens, chunk.cached_tokens
            if isinstance(self._emitter, ChatEmitter):
                self._emitter.set_fingerprint(chunk.system_fingerprint)
            self._start(out)
            return out
        self._start(out)
        if isinstance(chunk, Tokens):
            if self._pieces is None:
                raise ValueError("token ids need the model's token table")
            if not self._fed:  # ids: added tokens are symbols (stages.py, token mode)
                self._parser = OutputParser(self._spec, plain=self._plain, token_mode=True, hermes=self._hermes)
                self._fed = True
            ids = chunk.token_ids
            end = -1 if self._eos.isdisjoint(ids) else next(i for i, t in enumerate(ids) if t in self._eos)
            if self._plain:
                self.usage.completion_tokens += len(ids) if end < 0 else end
            text_ids = ids if end < 0 else ids[:end]  # the end-of-sentence id is no text: its logprob is not reported
            if chunk.logprobs is not None or self._track is not None:
                self._logprobs(text_ids, chunk.logprobs)
            self._feed(self._pieces.feed(text_ids), out)
            if end >= 0 and not self.done:
                self.usage.completion_tokens += 1  # the end-of-sentence token was generated too
                self._end("stop", out)
        elif isinstance(chunk, Text):
            self._fed = True
            events = self._parser.push([chunk.text])
            self.usage.completion_tokens += chunk.token_count
            self._events(events, out)
        else:
            self._end(chunk.reason, out)
        return out

    def finish(self) -> list[StreamEvent]:
        """The input is over. Without a Finish chunk before, the turn ends as a plain "stop"."""
        out: list[StreamEvent] = []
        if not self.done:
            self._start(out)
            self._end(None, out)
        return out

    def frames(self, events: list[StreamEvent]) -> list[bytes]:
        """SSE frames for `events`, with the API's closing frame (Chat: `data: [DONE]`) once done."""
        frames = sse(events)
        if self.done and events and self._emitter.done_frame:
            frames.append(self._emitter.done_frame)
        return frames

    def body(self) -> bytes:
        """The complete (non-streaming) response; only once done."""
        return self._emitter.body()

    def usage_object(self, usage: Usage) -> dict:
        """`usage` in this API's response shape (Chat and Completions: what a fan-out's merged response carries)."""
        return self._emitter.usage_object(usage)  # type: ignore[attr-defined]

    def closing_frames(self, usage: Usage) -> list[bytes]:
        """What ends a stream of several choices, after the last one: its usage chunk and the closing frame."""
        return [*sse(self._emitter.closing(usage)), DONE_FRAME]  # type: ignore[attr-defined]

    # --- internals -------------------------------------------------------------------------------------------

    def _start(self, out: list[StreamEvent]) -> None:
        if not self._started:
            self._started = True
            out += self._emitter.start(self.usage)

    def _logprobs(self, ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None) -> None:
        if self._track is None:
            assert self._table is not None and self._pieces is not None
            self._track = LogprobTrack(self._table, self._pieces, once=self._plain, as_ids=self._as_ids)
        self._track.feed(ids, logprobs)

    def _feed(self, pieces: list, out: list[StreamEvent]) -> None:
        """Token pieces: the usage counts the ids of the pieces parsed (not those after a stop sequence)."""
        assert self._pieces is not None
        counts = self._pieces.counts
        if self._track is not None:
            self._track.pieces(self._parser.seen, counts)
        events = self._parser.push(pieces)
        if not self._plain:  # chat-template models count every id, control tokens included (see push)
            self.usage.completion_tokens += sum(counts[: self._parser.consumed])
        self._events(events, out)

    def _events(self, events: list, out: list[StreamEvent]) -> None:
        emit, track = self._emitter.event, self._track
        if track is None:
            for ev in events:
                emit(ev, out)
        else:
            for ev, piece in zip(events, self._parser.event_pieces):
                emit(ev, out, track.entries(piece) if ev[0] in ("content", "reasoning") else None)
            track.release(self._parser.front)
        if self._parser.stopped and not self.done:
            self._end("stop", out)

    def _emit_all(self, events: list, out: list[StreamEvent]) -> None:
        """The events of the end (no stop check: the turn is ending anyway)."""
        emit, track = self._emitter.event, self._track
        for ev, piece in zip(events, self._parser.event_pieces):
            emit(ev, out, track.entries(piece) if track is not None and ev[0] in ("content", "reasoning") else None)

    def _end(self, reason: Literal["stop", "length", "content_filter"] | None, out: list[StreamEvent]) -> None:
        parser = self._parser
        if not parser.stopped:
            if self._pieces is not None:  # bytes still held: flushed, never lost (a deviation: see detok.py)
                tail = self._pieces.flush()
                if self._track is not None:
                    self._track.pieces(parser.seen, self._pieces.counts)
                self._emit_all(parser.push(tail), out)
                if not self._plain:
                    self.usage.completion_tokens += sum(self._pieces.counts[: parser.consumed])
            self._emit_all(parser.finish(), out)
        self.done = True
        finish: FinishReason
        if parser.stopped:
            finish = "stop_sequence"
        elif reason == "stop" and parser.tool_calls:
            finish = "tool_calls"
        else:
            finish = reason or "stop"
        self.finish_reason = finish
        if self._thinking and self._count is not None:
            self.usage.reasoning_tokens = self._count("".join(parser.reasoning))
        out += self._emitter.finish(Finish(finish, parser.stop_sequence), self.usage)
