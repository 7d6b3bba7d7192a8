"""gateway <-> recipe: an API request goes in, API-formatted events come back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrepareRequest:
    """The HTTP body as the client sent it; the recipe validates and renders it."""

    request_id: str
    api: str  # "chat" | "messages" | "completions" | "responses"
    body: bytes  # raw JSON object, already known to parse
    tenant: str = ""  # salts cache keys (API key presented); "" = anonymous
    client_request_id: str = ""  # the client's X-Request-Id (validated): the ids it sees derive from it


@dataclass(frozen=True)
class PrepareReply:
    """Either accepted (the request is now in flight and events will follow) or refused with an API error."""

    ok: bool
    status: int = 200
    error_body: bytes = b""  # the API's own error JSON when not ok
    stream: bool = False
    prompt_tokens: int = 0
    retry_after_s: int = 0  # a refusal for load (429): the Retry-After the client gets; 0 = none


@dataclass(frozen=True)
class ApiEvent:
    """What the gateway writes to the client, already formatted by the recipe.

    Streaming: `frames` are SSE frames ready to write (b"event: ...\\ndata: ...\\n\\n").
    Non-streaming: the last event carries `body`, the complete response JSON.
    `done` ends the request; `status` != 200 with `body` is an error response.
    """

    request_id: str
    seq: int
    frames: list[bytes] = field(default_factory=list)
    done: bool = False
    status: int = 200
    body: bytes = b""
    # metering for the gateway's /metrics: engine tokens taken so far (cumulative), prompt tokens found cached,
    # and on the `done` event the finish reason ("stop", "length", "stop_sequence", "tool_calls"; "" on errors)
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""


@dataclass(frozen=True)
class CountTokensRequest:
    """gateway -> recipe (`recipe.count_tokens`): how many prompt tokens would this request be?"""

    api: str  # the API whose request shape `body` has ("messages")
    body: bytes


@dataclass(frozen=True)
class CountTokensReply:
    status: int
    body: bytes  # the API's response JSON: the count, or its error body


@dataclass(frozen=True)
class JsonReply:
    """The recipe's whole answer to an HTTP request that generates nothing: the status and the JSON body
    (the result, or an error in the API's format)."""

    status: int
    body: bytes


@dataclass(frozen=True)
class TokenizeRequest:
    """gateway -> recipe (`recipe.tokenize`): vLLM's /tokenize body (a prompt, or chat messages)."""

    body: bytes


@dataclass(frozen=True)
class DetokenizeRequest:
    """gateway -> recipe (`recipe.detokenize`): vLLM's /detokenize body (token ids)."""

    body: bytes


@dataclass(frozen=True)
class ModelsRequest:
    """gateway -> recipe (`recipe.models`): which models do you serve, and how long is each one's context?"""


@dataclass(frozen=True)
class ModelCard:
    name: str
    max_model_len: int  # the context length the recipe enforces (prompt + completion tokens)


@dataclass(frozen=True)
class ModelsReply:
    models: list[ModelCard] = field(default_factory=list)


@dataclass(frozen=True)
class StoredResponseQuery:
    """gateway -> recipe (`recipe.responses.get` / `.delete`): one stored response, as seen by `tenant`."""

    response_id: str
    tenant: str = ""
