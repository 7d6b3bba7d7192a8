"""Logprobs in each API's shape (services/recipe/emit/logprobs.py and the emitters), for chat-template models and
Completions, which have no oracle (DeepSeek formats: tests/oracle/test_output_oracle.py, against the reference)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from services.recipe.emit import End, OutputProcessor, Ready, Tokens
from services.recipe.emit.logprobs import numbers, spell
from services.recipe.parse import TokenTable
from services.recipe.parse.stages import OPAQUE_SYM
from services.recipe.prepared import InferenceSpec, ParsingSpec, PreparedRequest
from shared.schemas.generate import TokenLogprob

# 0 "Hi", 1 " there", 2 "!", 3 end-of-sentence, 4 + 5 an emoji cut in two, 6 a control token, 7 " a"
TABLE = TokenTable(token_bytes=(b"Hi", b" there", b"!", b"", b" \xf0\x9f", b"\x98\x80", b"", b" a"),
                   added={3: (OPAQUE_SYM, "<eos>"), 6: (OPAQUE_SYM, "<|im_start|>")},
                   eos_ids=frozenset({3}), special_ids=frozenset({3, 6}))


def prepared(api: str, *, stream: bool, stop: list[str] | None = None, as_ids: bool = False) -> PreparedRequest:
    return PreparedRequest(api=api, model="m", encoding="chat_template", stream=stream,  # type: ignore[arg-type]
                           include_usage=False, conversation=None,
                           inference=InferenceSpec(None, None, None, logprobs=True, top_logprobs=2,
                                                   return_tokens_as_token_ids=as_ids),
                           parsing=ParsingSpec(stop_sequences=stop or []), echo={}, extra={})


def lp(i: int, tid: int) -> TokenLogprob:
    """The sampled id first, then id 2; values tell the positions apart."""
    return TokenLogprob(-0.5 * (i + 1), [tid, 2], [-0.5 * (i + 1), -4.0])


def run(api: str, chunks: list[list[int]], *, stream: bool, stop: list[str] | None = None,
        missing: int = -1, as_ids: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Stream chunks' data and the body; chunk `missing` comes without logprobs."""
    p = OutputProcessor(prepared(api, stream=stream, stop=stop, as_ids=as_ids), response_id="rid", created=7,
                        tokens=TABLE)
    events = p.push(Ready(3))
    pos = 0
    for n, ids in enumerate(chunks):
        lps = None if n == missing else [lp(pos + k, t) for k, t in enumerate(ids)]
        pos += len(ids)
        events += p.push(Tokens(ids, lps))
    events += p.push(End("stop")) + p.finish()
    return [orjson.loads(d) for _, d in events], orjson.loads(p.body())


@pytest.mark.parametrize("value, text", [
    (-0.25, "-0.25"), (-0.1, "-0.1"), (-1.1920928955078125e-07, "-1.1920929e-7"), (-1e-06, "-0.000001"),
    (-2.5e-06, "-0.0000025"), (-9.9e-07, "-9.9e-7"), (-1500000000000.0, "-1500000000000.0"), (-1e13, "-1e+13"),
    (-123456789.0, "-123456790.0"), (0.0, "0.0"), (-0.0, "-0.0"), (float("-inf"), "null"), (float("nan"), "null"),
])
def test_logprobs_are_written_as_the_f32_they_are(value: float, text: str) -> None:
    assert orjson.dumps(numbers([value, -0.5])).decode() == f"[{text},-0.5]"
    assert numbers([]) == []


def test_a_token_that_cuts_a_character_is_spelled_byte_by_byte() -> None:
    assert spell(b"Hi") == "Hi" and spell(" é".encode()) == " é"
    assert spell(b" \xf0\x9f") == "\\x20\\xf0\\x9f" and spell(b"") == ""


def test_chat_stream_chunks_carry_their_tokens_and_the_body_all() -> None:
    chunks, body = run("chat", [[0, 1], [4], [5, 2], [6, 3]], stream=True)
    deltas = [(c["choices"][0]["delta"].get("content"), c["choices"][0]["logprobs"]) for c in chunks]
    assert deltas[0] == ("", None) and deltas[-1] == ("", None)  # the role chunk, the finish chunk
    texts = [d for d, _ in deltas[1:-1]]
    assert texts == ["Hi there", " 😀!"]  # the held half of the emoji goes out with the rest
    tokens = [[(e["token"], e["logprob"]) for e in lps["content"]] for _, lps in deltas[1:-1]]
    assert tokens == [[("Hi", -0.5), (" there", -1.0)], [("\\x20\\xf0\\x9f", -1.5), ("\\x98\\x80", -2.0),
                                                          ("!", -2.5)]]
    first = deltas[1][1]["content"][0]
    assert first == {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": [
        {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}, {"token": "!", "logprob": -4.0, "bytes": [33]}]}
    # the control token and the end-of-sentence are no text: not reported
    _, whole = run("chat", [[0, 1], [4], [5, 2], [6, 3]], stream=False)
    streamed = [e for _, lps in deltas[1:-1] for e in lps["content"]]
    assert whole["choices"][0]["logprobs"] == {"content": streamed}
    assert body["choices"][0]["logprobs"] == whole["choices"][0]["logprobs"]


def test_an_answer_with_no_text_has_null_logprobs() -> None:
    _, body = run("chat", [[3]], stream=False)
    assert body["choices"][0]["message"]["content"] == "" and body["choices"][0]["logprobs"] is None


def test_a_stop_sequence_keeps_the_entries_of_the_text_before_it() -> None:
    chunks, _ = run("chat", [[0], [1, 2], [7]], stream=True, stop=["ere"])
    carried = [(c["choices"][0]["delta"].get("content"), c["choices"][0]["logprobs"]) for c in chunks[1:-1]]
    # " there!" holds the stop: its text is cut, its tokens (the piece's) are reported with what is left
    assert [(text, [e["token"] for e in lps["content"]]) for text, lps in carried] == [
        ("Hi", ["Hi"]), (" th", [" there", "!"])]


def test_ids_without_logprobs_keep_the_rest_aligned() -> None:
    chunks, _ = run("chat", [[0], [1], [2]], stream=True, missing=1)
    lps = [c["choices"][0]["logprobs"] for c in chunks[1:-1]]
    assert lps[1] is None
    assert [e["token"] for e in lps[0]["content"] + lps[2]["content"]] == ["Hi", "!"]


def test_completions_logprobs_are_parallel_lists_with_character_offsets() -> None:
    chunks, _ = run("completions", [[0, 1], [4], [5, 2]], stream=True)
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["text"]]
    assert parts[0] == {"tokens": ["Hi", " there"], "token_logprobs": [-0.5, -1.0],
                        "top_logprobs": [{"Hi": -0.5, "!": -4.0}, {" there": -1.0, "!": -4.0}],
                        "text_offset": [0, 2]}
    # " 😀!" starts at character 8; the emoji's second half starts inside it, "!" after it (2 characters on)
    assert parts[1]["tokens"] == ["\\x20\\xf0\\x9f", "\\x98\\x80", "!"] and parts[1]["text_offset"] == [8, 9, 10]
    _, body = run("completions", [[0, 1], [4], [5, 2]], stream=False)
    lps = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == "Hi there 😀!"
    assert lps["tokens"] == parts[0]["tokens"] + parts[1]["tokens"]
    assert lps["text_offset"] == [0, 2, 8, 9, 10]
    assert run("completions", [[3]], stream=False)[1]["choices"][0]["logprobs"] == {
        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def test_responses_output_text_deltas_and_the_part_carry_them() -> None:
    events, body = run("responses", [[0], [1, 2]], stream=True)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [[x["token"] for x in d["logprobs"]] for d in deltas] == [["Hi"], [" there", "!"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == deltas[0]["logprobs"] + deltas[1]["logprobs"]
    completed = next(e for e in events if e["type"] == "response.completed")
    assert completed["response"]["output"][0]["content"][0]["logprobs"] == done["logprobs"]
    _, whole = run("responses", [[0], [1, 2]], stream=False)
    assert whole["output"][0]["content"][0]["logprobs"] == done["logprobs"]


def test_tokens_as_token_ids_spell_each_id_and_keep_its_bytes() -> None:
    """vLLM's return_tokens_as_token_ids: a client gets the generated ids back exactly (a follow-up turn can
    send the answer as ids); offsets and bytes still come from the tokens' own bytes."""
    _, body = run("completions", [[0, 1], [4], [5, 2]], stream=False, as_ids=True)
    lps = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == "Hi there 😀!"
    assert lps["tokens"] == ["token_id:0", "token_id:1", "token_id:4", "token_id:5", "token_id:2"]
    assert lps["text_offset"] == [0, 2, 8, 9, 10]
    assert lps["top_logprobs"][0] == {"token_id:0": -0.5, "token_id:2": -4.0}
    chunks, _ = run("chat", [[0, 1], [7]], stream=True, as_ids=True)
    first = chunks[1]["choices"][0]["logprobs"]["content"][0]
    assert first["token"] == "token_id:0" and first["bytes"] == [72, 105]
    assert first["top_logprobs"][1] == {"token": "token_id:2", "logprob": -4.0, "bytes": [33]}


def test_tokens_as_token_ids_report_the_ids_that_make_no_text_on_the_next_delta() -> None:
    """A control token makes no text: as ids its entry rides on the next text delta, so the client still gets
    every id of the answer up to its last text (without as_ids it is not reported, as OpenAI reports text)."""
    _, body = run("completions", [[0], [6], [1]], stream=False, as_ids=True)
    assert body["choices"][0]["logprobs"]["tokens"] == ["token_id:0", "token_id:6", "token_id:1"]
    chunks, _ = run("completions", [[0], [6], [1]], stream=True, as_ids=True)
    streamed = [t for c in chunks if c["choices"][0]["text"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == ["token_id:0", "token_id:6", "token_id:1"]
    _, plain = run("completions", [[0], [6], [1]], stream=False)
    assert plain["choices"][0]["logprobs"]["tokens"] == ["Hi", " there"]
