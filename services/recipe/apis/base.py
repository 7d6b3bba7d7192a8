"""What every API adapter produces and consumes: a neutral request in, a response writer out.

An adapter validates its API's JSON body into a `ChatRequest` (or raises `Invalid` / `ApiError`), and formats
the generated text back: stream frames (SSE, ready to write) or one final response body. The service in
between knows nothing about any API's JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from services.recipe.apis.errors import ApiError


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, str]]  # {"role", "content"} with content flattened to text, ready for a template
    max_tokens: int | None  # None = fill the rest of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None = the service draws one (every request is reproducible from its logs)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # streaming: send a usage frame before the end
    continue_final: bool = False  # the last message is a partial assistant turn the model continues
    prompt: str | None = None  # raw prompt text (a completions-style API): no chat template


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" (end of turn) | "length" (max_tokens) | "stop_string"
    stop_string: str | None = None


class ResponseWriter(Protocol):
    """Formats one request's output. Streaming: start, delta*, finish. Non-streaming: body."""

    def start(self, usage: Usage) -> list[bytes]: ...

    def delta(self, text: str) -> list[bytes]: ...

    def finish(self, finish: Finish, usage: Usage) -> list[bytes]: ...

    def body(self, text: str, finish: Finish, usage: Usage) -> bytes: ...

    def error_frames(self, error: ApiError) -> list[bytes]: ...


class Api(Protocol):
    name: str

    def parse(self, body: Any) -> ChatRequest: ...

    def error(self, status: int, message: str, param: str | None = None) -> ApiError: ...

    def model_not_found(self, model: str) -> ApiError: ...

    def too_long(self, prompt_tokens: int, max_tokens: int | None, context: int) -> ApiError: ...

    def writer(self, request_id: str, req: ChatRequest, created: int) -> ResponseWriter: ...
