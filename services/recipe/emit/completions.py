"""OpenAI (legacy) Completions: `text_completion` chunks and response. No oracle: shaped after OpenAI's API
reference and vLLM. Completions continue raw text, so only answer text reaches here (no reasoning, no tool
calls: the processor parses completions as plain text with stop sequences).

Logprobs (when asked, `logprobs: n`): each chunk's `logprobs` has the tokens behind its text (emit/logprobs.py)
as parallel lists, `text_offset` counted in characters from the start of the completion; the response's has
them all.

Streaming: one chunk per text delta, a final chunk with `finish_reason`, then, when the client asked for it
(stream_options.include_usage), a usage chunk with no choices; until then chunks carry `"usage": null`.
"""

from __future__ import annotations

from typing import Any

from services.recipe.emit.base import DONE_FRAME, Finish, StreamEvent, Usage, dumps
from services.recipe.emit.logprobs import CompletionsLogprobs, Entry
from services.recipe.parse.stream import Event as ParseEvent

_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "content_filter": "content_filter",
           "tool_calls": "stop"}


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


class CompletionsEmitter:
    done_frame = DONE_FRAME

    def __init__(self, response_id: str, model: str, created: int, *, stream: bool, include_usage: bool,
                 logprobs: bool = False, choice: int | None = None) -> None:
        """`logprobs`: the request asked for them (the response then has a `logprobs` object, empty or not).
        `choice`: this stream is choice `choice` of several (n > 1, recipe/fanout.py): its chunks carry that
        index and no usage chunk nor `[DONE]` follows its end (the fan-out's `closing` comes after every choice)."""
        self._id, self._model, self._created = response_id, model, created
        self._choice = choice
        if choice is not None:
            self.done_frame = b""
        self._stream = stream
        self._include_usage = include_usage
        self._text: list[str] = []
        self._chars = 0  # characters of text so far: the next delta's text_offset
        self._logprobs = CompletionsLogprobs() if logprobs else None
        self._finish: Finish | None = None
        self._usage = Usage()
        self._head = dumps({"id": response_id, "object": "text_completion", "created": created, "model": model,
                            "system_fingerprint": None})[:-1] + b',"choices":[{"index":%d,"text":' % (choice or 0)
        self._lp_tail = b',"finish_reason":null}]' + (b',"usage":null}' if include_usage else b"}")
        self._tail = b',"logprobs":null' + self._lp_tail

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> StreamEvent:
        chunk: dict[str, Any] = {"id": self._id, "object": "text_completion", "created": self._created,
                                 "model": self._model, "system_fingerprint": None, "choices": choices}
        if self._include_usage:
            chunk["usage"] = usage
        return (None, dumps(chunk))

    def start(self, usage: Usage) -> list[StreamEvent]:
        return []

    def event(self, ev: ParseEvent, out: list[StreamEvent], logprobs: list[Entry] | None = None) -> None:
        if ev[0] != "content":
            return
        text = ev[1]
        self._text.append(text)
        tail = self._tail
        if logprobs and self._logprobs is not None:
            part = self._logprobs.add(logprobs, self._chars)
            tail = b',"logprobs":' + dumps(part) + self._lp_tail
        self._chars += len(text)
        if self._stream:
            out.append((None, self._head + dumps(text) + tail))

    def finish(self, finish: Finish, usage: Usage) -> list[StreamEvent]:
        self._finish, self._usage = finish, usage
        if not self._stream:
            return []
        choice = {"index": self._choice or 0, "text": "", "logprobs": None, "finish_reason": _FINISH[finish.reason]}
        out = [self._chunk([choice])]
        if self._include_usage and self._choice is None:
            out += self.closing(usage)
        return out

    def usage_object(self, usage: Usage) -> dict[str, Any]:
        return usage_json(usage)

    def closing(self, usage: Usage) -> list[StreamEvent]:
        """The usage chunk (no choices) that ends a stream, when the client asked for it."""
        return [self._chunk([], usage_json(usage))] if self._include_usage else []

    def body(self) -> bytes:
        assert self._finish is not None, "body() before finish()"
        choice = {"index": 0, "text": "".join(self._text),
                  "logprobs": None if self._logprobs is None else self._logprobs.json(),
                  "finish_reason": _FINISH[self._finish.reason]}
        return dumps({"id": self._id, "object": "text_completion", "created": self._created, "model": self._model,
                      "system_fingerprint": None, "choices": [choice], "usage": usage_json(self._usage)})
