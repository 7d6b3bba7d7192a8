"""OpenAI Chat Completions: request validation and `chat.completion` / `chat.completion.chunk` formatting.

Ignored knobs that do not change the response's shape (presence/frequency penalties, logit_bias, user,
metadata, store, service_tier, parallel_tool_calls); refused with a 400 those that would (n > 1, tools,
function calling, logprobs, JSON response formats, audio/image content).
"""

from __future__ import annotations

from typing import Any

import orjson

from services.recipe.apis import fields
from services.recipe.apis.base import ChatRequest, Finish, Usage
from services.recipe.apis.errors import ApiError, Invalid, openai_error

# API role -> template role ("developer" is the newer name for "system").
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOPS = 4
DONE_FRAME = b"data: [DONE]\n\n"


def _messages(value: Any) -> list[dict[str, str]]:
    if value is None:
        raise Invalid("messages: field required", "messages")
    if not isinstance(value, list):
        raise Invalid("messages: expected an array of messages", "messages")
    if not value:
        raise Invalid("messages: must contain at least one message", "messages")
    out = []
    for i, raw in enumerate(value):
        where = f"messages.{i}"
        message = fields.obj(raw, where)
        role = message.get("role")
        if role in ("tool", "function") or message.get("tool_calls") or message.get("function_call"):
            raise Invalid(f"{where}: tool and function messages are not supported yet", f"{where}.role")
        if not isinstance(role, str) or role not in _ROLES:
            raise Invalid(f"{where}.role: expected one of {sorted(_ROLES)}, got {role!r}", f"{where}.role")
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        text = fields.text_content(content, f"{where}.content")
        out.append({"role": _ROLES[role], "content": text})
    return out


def _parse(body: Any) -> ChatRequest:
    body = fields.obj(body)
    model = fields.required_str(body, "model")
    messages = _messages(body.get("messages"))
    n = fields.opt_int(body, "n", lo=1)
    if n is not None and n != 1:
        raise Invalid("n: only n=1 is supported", "n")
    for key, what in (("tools", "tools are"), ("functions", "functions are"), ("logprobs", "logprobs are"),
                      ("audio", "audio output is")):
        fields.reject_present(body, key, what)
    response_format = body.get("response_format")
    if response_format is not None and fields.obj(response_format, "response_format").get("type") != "text":
        raise Invalid("response_format: only {'type': 'text'} is supported yet", "response_format")

    max_tokens = fields.opt_int(body, "max_completion_tokens", lo=1)
    if max_tokens is None:
        max_tokens = fields.opt_int(body, "max_tokens", lo=1)
    top_k = fields.opt_int(body, "top_k", lo=-1)  # a vLLM extension; -1 = off, as there
    stream = fields.opt_bool(body, "stream")
    include_usage = False
    if body.get("stream_options") is not None:
        if not stream:
            raise Invalid("stream_options: only allowed when stream is true", "stream_options")
        include_usage = fields.opt_bool(fields.obj(body["stream_options"], "stream_options"), "include_usage")
    return ChatRequest(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=fields.opt_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=fields.opt_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(top_k or 0, 0),
        seed=fields.opt_int(body, "seed"),
        stop=fields.stop_strings(body.get("stop"), "stop", MAX_STOPS),
        stream=stream,
        include_usage=include_usage,
    )


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(finish: Finish) -> str:
    return "length" if finish.reason == "length" else "stop"


class ChatWriter:
    def __init__(self, request_id: str, req: ChatRequest, created: int) -> None:
        self._head = {"id": f"chatcmpl-{request_id}", "created": created, "model": req.model}
        self._include_usage = req.include_usage

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        chunk: dict[str, Any] = {
            **self._head, "object": "chat.completion.chunk", "system_fingerprint": None, "choices": choices
        }
        if self._include_usage:
            chunk["usage"] = usage
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def _choice(self, delta: dict[str, Any], reason: str | None = None) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]

    def start(self, usage: Usage) -> list[bytes]:
        return [self._chunk(self._choice({"role": "assistant", "content": ""}))]

    def delta(self, text: str) -> list[bytes]:
        return [self._chunk(self._choice({"content": text}))] if text else []

    def finish(self, finish: Finish, usage: Usage) -> list[bytes]:
        frames = [self._chunk(self._choice({}, finish_reason(finish)))]
        if self._include_usage:
            frames.append(self._chunk([], usage_json(usage)))
        return [*frames, DONE_FRAME]

    def body(self, text: str, finish: Finish, usage: Usage) -> bytes:
        message = {"role": "assistant", "content": text, "refusal": None}
        return orjson.dumps({
            **self._head,
            "object": "chat.completion",
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(finish)}],
            "usage": usage_json(usage),
        })

    def error_frames(self, error: ApiError) -> list[bytes]:
        return [b"data: " + error.body + b"\n\n", DONE_FRAME]


class OpenAIChat:
    name = "chat"

    def parse(self, body: Any) -> ChatRequest:
        try:
            return _parse(body)
        except Invalid as exc:
            raise openai_error(exc.status, exc.message, param=exc.param) from None

    def error(self, status: int, message: str, param: str | None = None) -> ApiError:
        return openai_error(status, message, param=param)

    def model_not_found(self, model: str) -> ApiError:
        return openai_error(
            404, f"The model `{model}` does not exist or you do not have access to it.", param="model",
            code="model_not_found",
        )

    def too_long(self, prompt_tokens: int, max_tokens: int | None, context: int) -> ApiError:
        if max_tokens is None:
            message = (f"This model's maximum context length is {context} tokens. However, your messages "
                       f"resulted in {prompt_tokens} tokens. Please reduce the length of the messages.")
        else:
            message = (f"This model's maximum context length is {context} tokens. However, you requested "
                       f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in "
                       "the completion). Please reduce the length of the messages or completion.")
        return openai_error(400, message, param="messages", code="context_length_exceeded")

    def writer(self, request_id: str, req: ChatRequest, created: int) -> ChatWriter:
        return ChatWriter(request_id, req, created)
