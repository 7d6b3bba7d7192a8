"""The contract between the recipe's input side (API request -> conversation -> prompt) and its output side
(generated tokens -> parsed text, reasoning, tool calls -> API events).

Conversion of any API request yields one `PreparedRequest`; the renderer turns its `conversation` into a prompt
and token ids; the stream parser and the API emitters read only `parsing`, `api`, `model`, `stream`,
`include_usage` and `echo`. Mirrors deepseek-recipe's `ConversationRequest` (conversation + inference options +
parsing options), which is the oracle for the DeepSeek formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Api = Literal["chat", "completions", "responses", "messages"]
ThinkingStage = Literal["reasoning_start", "reasoning_continuation", "content_continuation"]

# The id a client sees is this prefix + the request id (Responses items derive theirs from it).
RESPONSE_ID_PREFIXES: dict[str, str] = {"chat": "chatcmpl-", "completions": "cmpl-", "messages": "msg_", "responses": "resp_"}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: Any  # JSON schema (parsed JSON)
    strict: bool | None = None
    defer_loading: bool = False  # offered for calling but left out of the prompt's tool list (Responses)


@dataclass(frozen=True)
class OutputConstraint:
    kind: Literal["json", "regex", "grammar", "tool_call", "tool_call_required"]
    schema: str  # compact JSON schema, regex, EBNF grammar (vLLM's), tool list JSON, or "" for any JSON value
    # tool calls (not the reference's): at most one per answer (parallel_tool_calls false); a call must come though
    # the prompt is auto's (Anthropic's "any", which the reference serves as "auto")
    one_call: bool = False
    must_call: bool = False


@dataclass(frozen=True)
class InferenceSpec:
    """Sampling as the conversion resolved it; `max_tokens` None = the default for the mode (resolved once the
    prompt length is known)."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    output_constraint: OutputConstraint | None = None
    # vLLM's sampling extensions (convert/fields.py), neutral by default; the reference has none of them.
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as `token_id:N` (vLLM's), bytes still the token's
    # OpenAI's sampling fields the reference passes on to its backend (convert/fields.py reads them)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in [-100, 100]
    # thinking.budget_tokens (Anthropic's, and Chat's `thinking` object): reasoning tokens before the format's
    # end-of-thinking token is forced; None = no budget. Read in thinking mode only.
    reasoning_budget: int | None = None
    # n > 1 (Chat, Completions) and Completions best_of: `best_of` candidates are generated (fanout.py), the `n`
    # with the highest cumulative logprob returned; without best_of both are n
    n: int = 1
    best_of: int = 1


@dataclass(frozen=True)
class ParsingSpec:
    """How to read the model's output (the oracle's ParsingOptions)."""

    parse_tool_calls: bool = True
    starts_in_tool_calls: bool = False
    parse_json_output: bool = False
    thinking_initial_stage: ThinkingStage | None = None  # None = thinking mode off
    stop_sequences: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PreparedRequest:
    api: Api
    model: str  # the model name the client asked for (echoed in responses)
    encoding: str  # "v4" | "v41" | "chat_template"
    stream: bool
    include_usage: bool  # Chat Completions stream_options.include_usage
    conversation: Any  # services.recipe.conversation.Conversation
    inference: InferenceSpec
    parsing: ParsingSpec
    echo: dict[str, Any] = field(default_factory=dict)  # Responses: request settings the response reports
    extra: dict[str, Any] = field(default_factory=dict)  # API-specific bits the emitters need (e.g. namespace tool map)
    # Completions only: the raw prompt (no template, `conversation` is empty); text or token ids, not both.
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    cache_salt: str = ""  # the request's own `cache_salt` (on top of the tenant's) for its KV cache keys
