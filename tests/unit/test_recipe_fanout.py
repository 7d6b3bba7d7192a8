"""n > 1 and best_of (services/recipe/fanout.py): the candidates' ids and seeds, the conversion's bounds, and the
merge of their outputs (indices, usage, best_of's choice) through real Flights and output processors."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from services.recipe.convert import ConvertOptions, convert
from services.recipe.emit import OutputProcessor
from services.recipe.errors import FieldRefusal
from services.recipe.fanout import FanOut, choice_id, choice_seed
from services.recipe.flight import Flight
from services.recipe.parse import TokenTable
from shared.schemas.generate import TokenEvent, TokenLogprob

SMOL = "SmolLM2-135M-Instruct"
OPTIONS = ConvertOptions(models={SMOL: "chat_template", "DeepSeek-V4-Pro": "v4"})
TABLE = TokenTable(token_bytes=(b"Hi", b" there", b"!", b"<eos>"), added={}, eos_ids=frozenset({3}))
USER = {"role": "user", "content": "hi"}


def chat(**body: Any) -> Any:
    return convert("chat", {"model": SMOL, "messages": [USER], **body}, OPTIONS)


def completions(**body: Any) -> Any:
    return convert("completions", {"model": SMOL, "prompt": "Once", **body}, OPTIONS)


def test_candidate_ids_and_seeds() -> None:
    assert [choice_id("r1", i) for i in range(3)] == ["r1-c0", "r1-c1", "r1-c2"]
    seeds = [choice_seed(42, i) for i in range(16)]
    assert seeds[0] == 42 and len(set(seeds)) == 16 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [choice_seed(42, i) for i in range(16)]  # reproducible
    assert choice_seed(43, 1) != seeds[1]


def test_n_and_best_of_are_read_and_bounded() -> None:
    assert (chat(n=3).inference.n, chat(n=3).inference.best_of) == (3, 3)
    assert (completions(n=2, best_of=5).inference.n, completions(n=2, best_of=5).inference.best_of) == (2, 5)
    assert (completions(best_of=4).inference.n, completions(best_of=4).inference.best_of) == (1, 4)
    assert completions(n=3, stream=True).inference.n == 3  # n streams; best_of above n does not
    cases = [(chat, {"n": 17}, "n"), (chat, {"n": 0}, "n"), (completions, {"n": 17}, "n"),
             (completions, {"best_of": 17}, "best_of"), (completions, {"n": 3, "best_of": 2}, "best_of"),
             (completions, {"best_of": 2, "stream": True}, "best_of")]
    for make, body, name in cases:
        with pytest.raises(FieldRefusal) as info:
            make(**body)
        assert info.value.field == name and info.value.status == 400, body


def _fan(prepared: Any, k: int) -> FanOut:
    fan = FanOut("r", prepared)
    for i in range(k):
        processor = OutputProcessor(prepared, response_id="cmpl-r", created=0, tokens=TABLE, choice=i)
        fan.flights.append(Flight(choice_id("r", i), prepared, processor, 0.0))
    return fan


def _lp(*values: float) -> list[TokenLogprob]:
    return [TokenLogprob(v) for v in values]


def test_a_stream_of_three_choices_carries_their_indices_then_one_usage() -> None:
    prepared = chat(n=3, stream=True, stream_options={"include_usage": True})
    fan = _fan(prepared, 3)
    frames: list[bytes] = []
    outputs = [(2, TokenEvent("r-c2", 0, [0, 3], "stop", prompt_tokens=7, cached_tokens=6)),
               (0, TokenEvent("r-c0", 0, [0, 1], None, prompt_tokens=7, cached_tokens=0)),
               (1, TokenEvent("r-c1", 0, [1, 2, 3], "stop", prompt_tokens=7, cached_tokens=6)),
               (0, TokenEvent("r-c0", 2, [2, 3], "stop"))]
    for i, ev in outputs:
        out = fan.flights[i].on_event(ev, 0.0)
        assert out is not None
        merged = fan.take(fan.flights[i], out)
        assert merged is not None and merged.done == (ev is outputs[-1][1])
        frames += merged.frames
    assert frames[-1] == b"data: [DONE]\n\n" and frames.count(b"data: [DONE]\n\n") == 1
    chunks = [orjson.loads(f.removeprefix(b"data: ")) for f in frames[:-1]]
    text = {i: "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"] and c["choices"][0]["index"] == i) for i in range(3)}
    assert text == {0: "Hi there!", 1: " there!", 2: "Hi"}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["stop"] * 3
    assert all(c["usage"] is None for c in chunks[:-1])  # one usage, at the end, with no choices
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 7
    assert chunks[-1]["usage"]["completion_tokens"] == 4 + 3 + 2  # every choice's, each end-of-sentence included
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # what choice 0 found


def test_best_of_returns_the_n_most_likely_candidates_and_counts_them_all() -> None:
    prepared = completions(n=2, best_of=3, max_tokens=5)
    fan = _fan(prepared, 3)
    events = [TokenEvent("r-c0", 0, [0, 3], "stop", prompt_tokens=2, logprobs=_lp(-1.0, -0.5)),
              TokenEvent("r-c1", 0, [1, 1, 3], "stop", prompt_tokens=2, logprobs=_lp(-2.0, -2.0, -0.1)),
              TokenEvent("r-c2", 0, [2, 2], "length", prompt_tokens=2, logprobs=_lp(-0.2, -0.3))]
    merged = None
    for flight, ev in zip(fan.flights, events):
        out = flight.on_event(ev, 0.0)
        assert out is not None
        merged = fan.take(flight, out)
    assert merged is not None and merged.done and merged.status == 200
    body = orjson.loads(merged.body)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, "!!", "length"),
                                                                                      (1, "Hi", "stop")]
    assert "logprobs" in body["choices"][0] and body["choices"][0]["logprobs"] is None  # not asked for
    assert body["usage"]["completion_tokens"] == 2 + 3 + 2 and body["usage"]["prompt_tokens"] == 2
    assert body["id"] == "cmpl-r"


def test_a_failed_choice_fails_the_response() -> None:
    prepared = chat(n=2)
    fan = _fan(prepared, 2)
    out = fan.flights[0].on_event(TokenEvent("r-c0", 0, [0, 3], "stop", prompt_tokens=2), 0.0)
    assert out is not None and fan.take(fan.flights[0], out) is not None
    failed = fan.flights[1].on_event(TokenEvent("r-c1", 0, [], "error", error="boom", error_status=500), 0.0)
    assert failed is not None
    merged = fan.take(fan.flights[1], failed)
    assert merged is not None and merged.done and merged.status == 500
    assert orjson.loads(merged.body)["error"]["message"] == "boom"
    assert fan.take(fan.flights[0], out) is None  # over
