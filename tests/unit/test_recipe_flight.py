"""Flight: the per-request output state machine (reorder, detokenize, stop, format), no broker needed."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from services.recipe.apis import APIS
from services.recipe.flight import Flight, Output
from shared.models import resolve
from shared.schemas.generate import TokenEvent
from shared.tokenizer import Tokenizer, load_tokenizer

MODEL = "SmolLM2-135M-Instruct"
EOS = 2


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return load_tokenizer(resolve())


def _flight(smol: Tokenizer, api: str = "chat", max_tokens: int = 100, **body: Any) -> Flight:
    base: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens}
    req = APIS[api].parse({**base, **body})
    return Flight("r", APIS[api], req, APIS[api].writer("r", req, 0), smol, prompt_tokens=10,
                  max_tokens=max_tokens, stop_ids=smol.eos_ids, now=0.0)


def _events(ids: list[int], chunks: list[int], finish: str | None = "stop") -> list[TokenEvent]:
    """Split `ids` into consecutive events of the given sizes; the last carries `finish`."""
    events, pos = [], 0
    for n in chunks:
        events.append(TokenEvent("r", pos, ids[pos : pos + n], prompt_tokens=10 if pos == 0 else 0,
                                 cached_tokens=4 if pos == 0 else 0))
        pos += n
    last = events[-1]
    events[-1] = TokenEvent("r", last.index, last.token_ids, finish, last.prompt_tokens, last.cached_tokens)
    return events


def _stream_text(outs: list[Output]) -> str:
    text = ""
    for out in outs:
        for frame in out.frames:
            data = frame.removeprefix(b"data: ").strip()
            if data != b"[DONE]" and (chunk := orjson.loads(data))["choices"]:
                text += chunk["choices"][0]["delta"].get("content", "")
    return text


def _feed(flight: Flight, events: list[TokenEvent]) -> list[Output]:
    return [out for ev in events if (out := flight.on_event(ev, 1.0)) is not None]


def test_out_of_order_events_are_reordered(smol: Tokenizer) -> None:
    ids = smol.encode("The capital of France is Paris. 🙂") + [EOS]
    events = _events(ids, [1, 3, 2, len(ids) - 6], finish="stop")
    flight = _flight(smol, stream=True)
    outs = _feed(flight, [events[2], events[3], events[1]])
    assert outs == []  # nothing before position 0
    outs = _feed(flight, [events[0]])
    assert len(outs) == 1 and outs[0].done and not outs[0].cancel  # the engine finished itself
    assert _stream_text(outs) == "The capital of France is Paris. 🙂"
    assert flight.on_event(events[1], 2.0) is None  # late duplicates after the end are ignored


def test_non_streaming_body_with_usage(smol: Tokenizer) -> None:
    ids = smol.encode("Paris.") + [EOS]
    flight = _flight(smol)
    outs = _feed(flight, _events(ids, [1, len(ids) - 1]))
    assert [o.done for o in outs] == [False, True] and outs[0].frames == [] and outs[0].body == b""
    body = orjson.loads(outs[-1].body)
    assert body["choices"][0]["message"]["content"] == "Paris."
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": len(ids), "total_tokens": 10 + len(ids),
                             "prompt_tokens_details": {"cached_tokens": 4}}


def test_stop_string_truncates_and_asks_for_cancel(smol: Tokenizer) -> None:
    ids = smol.encode("one two END three four")
    flight = _flight(smol, stream=True, stop=["END"])
    outs = _feed(flight, _events(ids, [1] * len(ids), finish=None)[:-1] + _events(ids, [len(ids)])[-1:])
    assert outs[-1].done and outs[-1].cancel == "stop"  # the engine does not know: tell the workers
    assert _stream_text(outs) == "one two "
    finish_chunk = orjson.loads(outs[-1].frames[-2].removeprefix(b"data: "))
    assert finish_chunk["choices"][0]["finish_reason"] == "stop"
    assert sum(1 for o in outs if o.done) == 1


def test_eos_before_engine_finish_is_not_rendered(smol: Tokenizer) -> None:
    flight = _flight(smol, api="messages", max_tokens=50)
    ids = smol.encode("Hello") + [EOS] + smol.encode(" junk")
    out = flight.on_event(TokenEvent("r", 0, ids, prompt_tokens=10), 1.0)
    assert out is not None and out.done and out.cancel == "stop"
    body = orjson.loads(out.body)
    assert body["content"] == [{"type": "text", "text": "Hello"}] and body["stop_reason"] == "end_turn"
    assert body["usage"]["output_tokens"] == len(smol.encode("Hello")) + 1


def test_max_tokens_reached_finishes_with_length(smol: Tokenizer) -> None:
    ids = smol.encode("a b c d e f g h")
    flight = _flight(smol, api="messages", max_tokens=3, stream=True)
    out = flight.on_event(TokenEvent("r", 0, ids, prompt_tokens=10), 1.0)
    assert out is not None and out.done
    frames = b"".join(out.frames).decode()
    assert '"stop_reason":"max_tokens"' in frames and '"output_tokens":3' in frames
    assert frames.startswith("event: message_start")


def test_held_back_text_is_released_at_the_end(smol: Tokenizer) -> None:
    ids = smol.encode("value: E")
    flight = _flight(smol, stream=True, stop=["END"])
    outs = _feed(flight, [TokenEvent("r", 0, ids), TokenEvent("r", len(ids), [], finish_reason="length")])
    assert _stream_text(outs[:1]) == "value: "
    assert _stream_text(outs) == "value: E"  # "E" was held as a possible "END", then released


def test_token_less_final_event_waits_for_the_gap(smol: Tokenizer) -> None:
    ids = smol.encode("Hi there")
    flight = _flight(smol, stream=True)
    assert flight.on_event(TokenEvent("r", len(ids), [], finish_reason="length"), 1.0) is None
    out = flight.on_event(TokenEvent("r", 0, ids, prompt_tokens=10), 1.0)
    assert out is not None and out.done and not out.cancel
    assert _stream_text([out]) == "Hi there"


def test_mesh_error_becomes_an_api_error(smol: Tokenizer) -> None:
    flight = _flight(smol, api="messages", stream=True)
    flight.on_event(TokenEvent("r", 0, smol.encode("Hi"), prompt_tokens=10), 1.0)
    out = flight.on_event(TokenEvent("r", 5, [], finish_reason="error", error="no decode worker", error_status=503),
                          2.0)
    assert out is not None and out.done and out.status == 503 and not out.cancel
    assert orjson.loads(out.body)["error"] == {"type": "overloaded_error", "message": "no decode worker"}
    assert out.frames[0].startswith(b"event: error\n")
    assert flight.last_seen == 2.0


def test_seq_numbers_increase(smol: Tokenizer) -> None:
    flight = _flight(smol)
    assert [flight.next_seq() for _ in range(3)] == [0, 1, 2]
