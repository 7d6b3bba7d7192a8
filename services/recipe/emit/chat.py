"""OpenAI Chat Completions: `chat.completion.chunk` stream events and the `chat.completion` response, shaped
as deepseek-recipe shapes them (DeepSeek's API): `reasoning_content` beside `content` in thinking mode, tool
calls as OpenAI deltas, and usage with DeepSeek's `prompt_cache_hit_tokens` / `prompt_cache_miss_tokens`
next to OpenAI's `prompt_tokens_details.cached_tokens`.

In thinking mode the message reports `reasoning_content` once there is any (a turn that starts in reasoning
reports "" from its first chunk; a continued answer reports none until reasoning arrives, i.e. never).

Usage rides on the final chunk (the one with `finish_reason`). Chunks before it carry `"usage": null` when
the client asked for usage (stream_options.include_usage) and no usage key otherwise.

The hot path is one content (or reasoning) delta per parser event: its chunk is prebuilt bytes around the
JSON-encoded text, not a dict serialized per token.

Logprobs (when asked): a chunk's `logprobs` holds the entries of the tokens behind its delta (emit/logprobs.py)
under `content` or, for reasoning, `reasoning_content` (deepseek-recipe's key; OpenAI's reasoning models report
none); the response's `logprobs` holds all of them, `content` first, each key only when it has entries, or null.
"""

from __future__ import annotations

import secrets
from typing import Any

from services.recipe.emit.base import DONE_FRAME, Finish, StreamEvent, Usage, dumps
from services.recipe.emit.logprobs import Entry, openai_json
from services.recipe.parse.stream import Event as ParseEvent

_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "content_filter": "content_filter",
           "tool_calls": "tool_calls"}


def usage_json(usage: Usage, thinking: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if thinking:
        out["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    out["prompt_cache_hit_tokens"] = usage.cached_tokens
    out["prompt_cache_miss_tokens"] = usage.miss_tokens
    return out


def call_id(index: int) -> str:
    return f"call_{index:02d}_{secrets.token_urlsafe(18)}"


class ChatEmitter:
    done_frame = DONE_FRAME

    def __init__(
        self, response_id: str, model: str, created: int, *, thinking: bool, stream: bool, include_usage: bool,
        reasoning_first: bool = True, choice: int | None = None,
    ) -> None:
        """`thinking`: thinking mode (reasoning fields and usage); `reasoning_first`: the turn starts in
        reasoning (not a continued answer). `choice`: this stream is choice `choice` of several (n > 1,
        recipe/fanout.py): its chunks carry that index, its final chunk no usage and no `[DONE]` follows it (the
        fan-out sends the request's usage, `closing`, and `[DONE]` once every choice is done)."""
        self._id, self._model, self._created = response_id, model, created
        self._choice = choice
        if choice is not None:
            self.done_frame = b""
        self._thinking = thinking
        self._has_reasoning = thinking and reasoning_first
        self._stream = stream
        self._usage_key = include_usage or not stream  # deepseek-recipe: "usage": null on every chunk then
        self._fingerprint: str | None = None
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._args: list[list[str]] = []
        self._finish: Finish | None = None
        self._usage = Usage()
        self._head = b""
        self._tail = b""
        self._lp_tail = b""
        self._lp: dict[str, list[dict[str, Any]]] = {"content": [], "reasoning_content": []}

    def set_fingerprint(self, fingerprint: str | None) -> None:
        self._fingerprint = fingerprint

    def _prebuild(self) -> None:
        head = {"id": self._id, "object": "chat.completion.chunk", "created": self._created, "model": self._model,
                "system_fingerprint": self._fingerprint}
        self._head = dumps(head)[:-1] + b',"choices":[{"index":%d,"delta":' % (self._choice or 0)
        self._lp_tail = b',"finish_reason":null}]' + (b',"usage":null}' if self._usage_key else b"}")
        self._tail = b',"logprobs":null' + self._lp_tail
        null = b',"reasoning_content":null}' if self._thinking else b"}"
        self._content_open, self._content_close = b'{"content":', null
        self._reasoning_open = b'{"content":null,"reasoning_content":'

    def _chunk(self, delta: bytes) -> StreamEvent:
        return (None, self._head + delta + self._tail)

    def _logprobs(self, key: str, entries: list[Entry] | None) -> bytes:
        """The chunk's tail with its `logprobs`; the entries also go into the response's."""
        if not entries:
            return self._tail
        items = openai_json(entries)
        self._lp[key] += items
        return b',"logprobs":' + dumps({key: items}) + self._lp_tail

    def start(self, usage: Usage) -> list[StreamEvent]:
        self._prebuild()
        if not self._stream:
            return []
        if self._has_reasoning:
            delta = b'{"role":"assistant","content":null,"reasoning_content":""}'
        elif self._thinking:
            delta = b'{"role":"assistant","content":"","reasoning_content":null}'
        else:
            delta = b'{"role":"assistant","content":""}'
        return [self._chunk(delta)]

    def event(self, ev: ParseEvent, out: list[StreamEvent], logprobs: list[Entry] | None = None) -> None:
        kind = ev[0]
        if kind == "content":
            self._content.append(ev[1])
            tail = self._logprobs("content", logprobs)
            if self._stream:
                out.append((None, self._head + self._content_open + dumps(ev[1]) + self._content_close + tail))
        elif kind == "reasoning":
            self._has_reasoning = True
            self._reasoning.append(ev[1])
            tail = self._logprobs("reasoning_content", logprobs)
            if self._stream:
                out.append((None, self._head + self._reasoning_open + dumps(ev[1]) + b"}" + tail))
        elif kind == "args":
            index, text = ev[1], ev[2]
            self._args[index].append(text)
            if self._stream:
                call = {"index": index, "function": {"arguments": text}}
                out.append(self._chunk(dumps({"tool_calls": [call]})))
        elif kind == "tool":
            index, name = ev[1], ev[2]
            call = {"index": index, "id": call_id(index), "type": "function",
                    "function": {"name": name, "arguments": ""}}
            self._calls.append(call)
            self._args.append([])
            if self._stream:
                out.append(self._chunk(dumps({"tool_calls": [call]})))

    def finish(self, finish: Finish, usage: Usage) -> list[StreamEvent]:
        self._finish, self._usage = finish, usage
        if not self._stream:
            return []
        delta: dict[str, Any] = {"content": ""}
        if self._thinking:
            delta["reasoning_content"] = None
        chunk = {"id": self._id, "object": "chat.completion.chunk", "created": self._created, "model": self._model,
                 "system_fingerprint": self._fingerprint,
                 "choices": [{"index": self._choice or 0, "delta": delta, "logprobs": None,
                              "finish_reason": _FINISH[finish.reason]}],
                 "usage": usage_json(usage, self._thinking)}
        if self._choice is not None:  # the request's usage comes once, after every choice (closing)
            if self._usage_key:
                chunk["usage"] = None
            else:
                del chunk["usage"]
        return [(None, dumps(chunk))]

    def usage_object(self, usage: Usage) -> dict[str, Any]:
        return usage_json(usage, self._thinking)

    def closing(self, usage: Usage) -> list[StreamEvent]:
        """After the last choice of several: the request's usage in a chunk of its own (no choices), as OpenAI
        sends it; always, as a single stream always carries its usage on its final chunk."""
        return [(None, dumps({"id": self._id, "object": "chat.completion.chunk", "created": self._created,
                              "model": self._model, "system_fingerprint": self._fingerprint, "choices": [],
                              "usage": usage_json(usage, self._thinking)}))]

    def body(self) -> bytes:
        assert self._finish is not None, "body() before finish()"
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._content)}
        if self._has_reasoning:
            message["reasoning_content"] = "".join(self._reasoning)
        if self._calls:
            message["tool_calls"] = [
                {**call, "function": {"name": call["function"]["name"], "arguments": "".join(args)}}
                for call, args in zip(self._calls, self._args)
            ]
        return dumps({
            "id": self._id, "object": "chat.completion", "created": self._created, "model": self._model,
            "choices": [{"index": 0, "message": message, "logprobs": {k: v for k, v in self._lp.items() if v} or None,
                         "finish_reason": _FINISH[self._finish.reason]}],
            "usage": usage_json(self._usage, self._thinking),
            "system_fingerprint": self._fingerprint,
        })
