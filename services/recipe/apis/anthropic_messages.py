"""Anthropic Messages: request validation and `message` / SSE event formatting.

A final assistant message is a prefill: the model continues it and the response holds only the continuation.
Usage follows Anthropic's accounting: `input_tokens` counts the prompt tokens NOT read from the cache, so
input_tokens + cache_read_input_tokens = the whole prompt; nothing is billed as a cache write.
"""

from __future__ import annotations

from typing import Any

import orjson

from services.recipe.apis import fields
from services.recipe.apis.base import ChatRequest, Finish, Usage
from services.recipe.apis.errors import ApiError, Invalid, anthropic_error

_ROLES = ("user", "assistant")
MAX_STOPS = 32  # Anthropic sets no documented limit; each one costs a scan per streamed piece
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "stop_string": "stop_sequence"}


def _messages(value: Any) -> list[dict[str, str]]:
    if value is None:
        raise Invalid("messages: field required", "messages")
    if not isinstance(value, list):
        raise Invalid("messages: expected an array of messages", "messages")
    if not value:
        raise Invalid("messages: at least one message is required", "messages")
    out = []
    for i, raw in enumerate(value):
        where = f"messages.{i}"
        message = fields.obj(raw, where)
        role = message.get("role")
        if role not in _ROLES:
            raise Invalid(f"{where}.role: expected 'user' or 'assistant', got {role!r}", f"{where}.role")
        if message.get("content") is None:
            raise Invalid(f"{where}.content: field required", f"{where}.content")
        out.append({"role": role, "content": fields.text_content(message["content"], f"{where}.content")})
    return out


def _system(value: Any) -> list[dict[str, str]]:
    if value is None:
        return []
    text = fields.text_content(value, "system")
    return [{"role": "system", "content": text}] if text else []


def _parse(body: Any) -> ChatRequest:
    body = fields.obj(body)
    model = fields.required_str(body, "model")
    if body.get("max_tokens") is None:
        raise Invalid("max_tokens: field required", "max_tokens")
    max_tokens = fields.opt_int(body, "max_tokens", lo=1)
    messages = _messages(body.get("messages"))
    fields.reject_present(body, "tools", "tools are")
    thinking = body.get("thinking")
    if thinking is not None and fields.obj(thinking, "thinking").get("type") != "disabled":
        raise Invalid("thinking: extended thinking is not supported by this model yet", "thinking")
    continue_final = messages[-1]["role"] == "assistant" and messages[-1]["content"] != ""
    if continue_final and messages[-1]["content"] != messages[-1]["content"].rstrip():
        raise Invalid("messages: final assistant content cannot end with trailing whitespace", "messages")
    if messages[-1]["role"] == "assistant" and not continue_final:
        messages = messages[:-1]  # an empty prefill asks for nothing: answer the conversation before it
        if not messages:
            raise Invalid("messages: the conversation has no user turn", "messages")
    top_k = fields.opt_int(body, "top_k", lo=0)
    return ChatRequest(
        model=model,
        messages=_system(body.get("system")) + messages,
        max_tokens=max_tokens,
        temperature=fields.opt_number(body, "temperature", 1.0, 0.0, 1.0),
        top_p=fields.opt_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=top_k or 0,
        stop=fields.stop_strings(body.get("stop_sequences"), "stop_sequences", MAX_STOPS, one_string_ok=False),
        stream=fields.opt_bool(body, "stream"),
        include_usage=True,  # Anthropic always reports usage
        continue_final=continue_final,
    )


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


class MessagesWriter:
    def __init__(self, request_id: str, req: ChatRequest, created: int) -> None:
        self._head = {"id": f"msg_{request_id}", "type": "message", "role": "assistant", "model": req.model}

    def start(self, usage: Usage) -> list[bytes]:
        message = {**self._head, "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage_json(usage)}
        return [
            _event("message_start", {"message": message}),
            _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        ]

    def delta(self, text: str) -> list[bytes]:
        if not text:
            return []
        return [_event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})]

    def finish(self, finish: Finish, usage: Usage) -> list[bytes]:
        delta = {"stop_reason": _STOP_REASONS[finish.reason], "stop_sequence": finish.stop_string}
        return [
            _event("content_block_stop", {"index": 0}),
            _event("message_delta", {"delta": delta, "usage": usage_json(usage)}),
            _event("message_stop", {}),
        ]

    def body(self, text: str, finish: Finish, usage: Usage) -> bytes:
        return orjson.dumps({
            **self._head,
            "content": [{"type": "text", "text": text}],
            "stop_reason": _STOP_REASONS[finish.reason],
            "stop_sequence": finish.stop_string,
            "usage": usage_json(usage),
        })

    def error_frames(self, error: ApiError) -> list[bytes]:
        return [b"event: error\ndata: " + error.body + b"\n\n"]


class AnthropicMessages:
    name = "messages"

    def parse(self, body: Any) -> ChatRequest:
        try:
            return _parse(body)
        except Invalid as exc:
            raise anthropic_error(exc.status, exc.message) from None

    def error(self, status: int, message: str, param: str | None = None) -> ApiError:
        return anthropic_error(status, message)

    def model_not_found(self, model: str) -> ApiError:
        return anthropic_error(404, f"model: {model}")

    def too_long(self, prompt_tokens: int, max_tokens: int | None, context: int) -> ApiError:
        if max_tokens is None or prompt_tokens >= context:
            return anthropic_error(400, f"prompt is too long: {prompt_tokens} tokens > {context - 1} maximum")
        return anthropic_error(
            400,
            f"input length and `max_tokens` exceed context limit: {prompt_tokens} + {max_tokens} > {context}, "
            "decrease input length or `max_tokens` and try again",
        )

    def writer(self, request_id: str, req: ChatRequest, created: int) -> MessagesWriter:
        return MessagesWriter(request_id, req, created)
