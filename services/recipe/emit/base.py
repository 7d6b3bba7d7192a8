"""What every API emitter shares: the usage numbers, the finish, the emitter interface and SSE framing.

An emitter turns the parser's API-neutral events (stream.py) into one API's stream events and, at the end,
its complete response. Stream events are (SSE event name or None, JSON bytes): built once, ready to frame.
Every emitter also accumulates the complete response as it goes, so a non-streaming request needs no second
pass (and no JSON parsing of its own events).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import orjson

from services.recipe.parse.stream import Event as ParseEvent

if TYPE_CHECKING:
    from services.recipe.emit.logprobs import Entry

StreamEvent = tuple[str | None, bytes]  # (SSE event name, None = an unnamed `data:` line; JSON data)

# The neutral finish reasons: deepseek-recipe's, plus "stop_sequence" (a stop sequence ended the answer).
FinishReason = Literal["stop", "length", "content_filter", "tool_calls", "stop_sequence"]

DONE_FRAME = b"data: [DONE]\n\n"


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (DeepSeek: prompt_cache_hit_tokens)
    completion_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def miss_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class Finish:
    reason: FinishReason
    stop_sequence: str | None = None


class Emitter(Protocol):
    """One request's output in one API. `start` once (the prompt usage is known), `event` per parser event,
    `finish` once; each returns the stream events to send (empty when not streaming). `body` after finish.
    `logprobs`: the entries a text event carries when the request asked for them (emit/logprobs.py), else
    None; an API without logprobs (Messages) ignores them."""

    def start(self, usage: Usage) -> list[StreamEvent]: ...

    def event(self, ev: ParseEvent, out: list[StreamEvent], logprobs: list[Entry] | None = None) -> None: ...

    def finish(self, finish: Finish, usage: Usage) -> list[StreamEvent]: ...

    def body(self) -> bytes: ...

    done_frame: bytes  # written after the last event (Chat/Completions: `data: [DONE]`), or b""


def dumps(value: object) -> bytes:
    return orjson.dumps(value)


def sse(events: Iterable[StreamEvent]) -> list[bytes]:
    """SSE frames ready to write: `data: {json}\\n\\n`, named ones with `event: NAME\\n` first."""
    frames = []
    for name, data in events:
        if name is None:
            frames.append(b"data: " + data + b"\n\n")
        else:
            frames.append(b"event: " + name.encode() + b"\ndata: " + data + b"\n\n")
    return frames


def parse_arguments(text: str) -> object:
    """A tool call's arguments as JSON, or {} when they are not one object (a call cut off by max_tokens), as
    deepseek-recipe's Messages accumulation does; numbers as serde_json reads them (a float stays a float,
    an integer beyond 64 bits becomes a float)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return _parse_wide(text)
    return value if isinstance(value, dict) else {}


def _parse_wide(text: str) -> object:
    """orjson refuses integers past 64 bits; the stdlib reads them (as floats, serde_json's way)."""
    import json  # rare path: imported on first use

    def reject(_: str) -> float:
        raise ValueError("not JSON")

    def integer(s: str) -> int | float:
        value = int(s)
        return value if -(2**63) <= value < 2**64 else float(value)

    def real(s: str) -> float:
        value = float(s)
        if value in (float("inf"), float("-inf")):
            raise ValueError("number out of range")
        return value

    try:
        value = json.loads(text, parse_int=integer, parse_float=real, parse_constant=reject)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}
