"""gateway <-> recipe: an API request goes in, API-formatted events come back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Resume:
    """A request in flight whose recipe died, handed to another recipe (or the restarted one) by the gateway,
    which holds the client's side: what the lost recipe had said (its PrepareReply, its ApiEvents). The new recipe
    prepares the same body again (the same prompt), replays `token_ids` through a fresh output side without
    sending anything (the client has that output), and resumes generation after them as a continuation (as for a
    lost worker), past every migration the lost recipe may have started."""

    seed: int  # the sampling seed the lost recipe used (drawn by it when the client gave none)
    created: int  # the response's creation time the client has seen
    token_ids: list[int]  # the engine tokens whose output the client has, in order
    cached_tokens: int  # the prompt tokens found cached, for the usage
    migration: int  # the latest migration of the request the lost recipe reported
    epoch: int  # how many recipes the request has lost: the new recipe's events carry it


@dataclass(frozen=True)
class PrepareRequest:
    """The HTTP body as the client sent it; the recipe validates and renders it."""

    request_id: str
    api: str  # "chat" | "messages" | "completions" | "responses"
    body: bytes  # raw JSON object, already known to parse
    tenant: str = ""  # salts cache keys (API key presented); "" = anonymous
    client_request_id: str = ""  # the client's X-Request-Id (validated): the ids it sees derive from it
    resume: Resume | None = None  # the request's recipe died mid-flight: go on from there


@dataclass(frozen=True)
class PrepareReply:
    """Either accepted (the request is now in flight and events will follow) or refused with an API error."""

    ok: bool
    status: int = 200
    error_body: bytes = b""  # the API's own error JSON when not ok
    stream: bool = False
    prompt_tokens: int = 0
    retry_after_s: int = 0  # a refusal for load (429): the Retry-After the client gets; 0 = none
    # accepted: the recipe process that took it (its Presence.boot: the gateway watches that it stays), and what
    # another recipe needs to go on with the request should that one die (Resume)
    recipe: str = ""
    seed: int = 0
    created: int = 0


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
    # the engine tokens taken since the previous event (in order: the output these frames and the earlier ones
    # came from), the request's migration now, and the recipe's epoch (Resume.epoch; 0 = the first recipe)
    token_ids: list[int] = field(default_factory=list)
    migration: int = 0
    epoch: int = 0


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
