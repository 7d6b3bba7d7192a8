"""Anthropic Messages: message_start / content_block_* / message_delta / message_stop, and the `message`
response, as deepseek-recipe shapes them.

Content blocks open lazily, when the first delta of their kind arrives, and close when another kind takes
over (a thinking block closes with a `signature_delta`, the response id unless one was given). In thinking
mode the thinking block opens with the message, even if no reasoning follows. A `ping` follows the first
content_block_start. A tool call is a `tool_use` block whose input streams as `input_json_delta`; the
complete response parses that JSON ({} when it is not valid, e.g. cut off by max_tokens).

Usage follows Anthropic's accounting: `input_tokens` are the prompt tokens not read from the cache.
"""

from __future__ import annotations

from typing import Any

from services.recipe.emit.base import Finish, StreamEvent, Usage, dumps, parse_arguments
from services.recipe.emit.chat import call_id
from services.recipe.parse.stream import Event as ParseEvent

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "stop_sequence": "stop_sequence", "content_filter": "refusal"}


def usage_json(usage: Usage, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": usage.miss_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens, "output_tokens": output_tokens,
            "service_tier": "standard"}


def _event(name: str, data: dict[str, Any]) -> StreamEvent:
    return (name, dumps(data))


class MessagesEmitter:
    done_frame = b""

    def __init__(self, response_id: str, model: str, *, thinking: bool, stream: bool, signature: str | None = None):
        self._id, self._model = response_id, model
        self._thinking = thinking
        self._stream = stream
        self._signature = response_id if signature is None else signature
        self._blocks: list[dict[str, Any]] = []  # the response's content, built as it streams
        self._parts: list[list[str]] = []  # text / thinking / partial JSON of each block
        self._kind = ""  # the open block's kind: "thinking" | "text" | "tool_use" | ""
        self._finish: Finish | None = None
        self._usage = Usage()
        self._delta_head = b""

    def start(self, usage: Usage) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self._stream:
            message = {"id": self._id, "type": "message", "role": "assistant", "model": self._model, "content": [],
                       "stop_reason": None, "stop_sequence": None, "usage": usage_json(usage, 0)}
            out.append(_event("message_start", {"type": "message_start", "message": message}))
        if self._thinking:
            self._open({"type": "thinking", "thinking": "", "signature": ""}, out)
        return out

    def _open(self, block: dict[str, Any], out: list[StreamEvent]) -> None:
        index = len(self._blocks)
        self._blocks.append(block)
        self._parts.append([])
        self._kind = block["type"]
        if self._stream:
            out.append(_event("content_block_start", {"type": "content_block_start", "index": index,
                                                      "content_block": block}))
            if index == 0:
                out.append(("ping", b'{"type":"ping"}'))
            self._delta_head = b'{"type":"content_block_delta","index":' + str(index).encode() + b',"delta":'

    def _close(self, out: list[StreamEvent]) -> None:
        index = len(self._blocks) - 1
        if self._kind == "thinking" and self._stream:
            delta = {"type": "signature_delta", "signature": self._signature}
            out.append(("content_block_delta", self._delta_head + dumps(delta) + b"}"))
        if self._stream:
            out.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        self._kind = ""

    def _delta(self, kind: str, field: str, text: str, out: list[StreamEvent]) -> None:
        self._parts[-1].append(text)
        if self._stream:
            data = b'{"type":"' + kind.encode() + b'","' + field.encode() + b'":' + dumps(text) + b"}"
            out.append(("content_block_delta", self._delta_head + data + b"}"))

    def event(self, ev: ParseEvent, out: list[StreamEvent], logprobs: object = None) -> None:
        """`logprobs` are ignored: Anthropic's Messages API has no field for them."""
        kind = ev[0]
        if kind == "content":
            if self._kind != "text":
                if self._kind:
                    self._close(out)
                self._open({"type": "text", "text": ""}, out)
            self._delta("text_delta", "text", ev[1], out)
        elif kind == "reasoning":
            if self._kind == "thinking":  # reasoning only ever comes first, while the thinking block is open
                self._delta("thinking_delta", "thinking", ev[1], out)
        elif kind == "args":
            self._delta("input_json_delta", "partial_json", ev[2], out)
        elif kind == "tool":
            if self._kind:
                self._close(out)
            self._open({"type": "tool_use", "id": call_id(ev[1]), "name": ev[2], "input": {}}, out)

    def finish(self, finish: Finish, usage: Usage) -> list[StreamEvent]:
        self._finish, self._usage = finish, usage
        out: list[StreamEvent] = []
        if self._kind:
            self._close(out)
        if self._stream:
            delta = {"stop_reason": _STOP_REASONS[finish.reason], "stop_sequence": finish.stop_sequence}
            out.append(_event("message_delta", {"type": "message_delta", "delta": delta,
                                                "usage": usage_json(usage, usage.completion_tokens)}))
            out.append(("message_stop", b'{"type":"message_stop"}'))
        return out

    def body(self) -> bytes:
        assert self._finish is not None, "body() before finish()"
        content = []
        for block, parts in zip(self._blocks, self._parts):
            text = "".join(parts)
            if block["type"] == "thinking":
                content.append({"type": "thinking", "thinking": text, "signature": self._signature})
            elif block["type"] == "text":
                content.append({"type": "text", "text": text})
            else:
                content.append({**block, "input": parse_arguments(text)})
        return dumps({
            "id": self._id, "type": "message", "role": "assistant", "model": self._model, "content": content,
            "stop_reason": _STOP_REASONS[self._finish.reason], "stop_sequence": self._finish.stop_sequence,
            "usage": usage_json(self._usage, self._usage.completion_tokens),
        })
