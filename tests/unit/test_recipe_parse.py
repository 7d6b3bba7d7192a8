"""The output parser on its own: the matcher, the detokenizer, the parser's events (no oracle needed)."""

from __future__ import annotations

import json

import pytest

from services.recipe.parse import OutputParser, TokenPieces, TokenTable
from services.recipe.parse import stages as st
from services.recipe.parse.machine import LEADING, NL_STR, QUOTE_SPACE, STR, Act, Machine, branch, stage
from services.recipe.parse.stream import json_escape, key_escape
from services.recipe.prepared import ParsingSpec

A, B, U, AFTER = Act("a"), Act("b"), Act("unmatched"), Act("after")


def machine(*branches: tuple[int, str, Act]) -> Machine:
    stages = {"s": stage([branch(kind, pattern, "t", act) for kind, pattern, act in branches], U),
              "t": stage([], AFTER)}
    return Machine(stages, "s")


def parse(chunks: list[str], **spec: object) -> list[tuple]:
    p = OutputParser(ParsingSpec(**spec))  # type: ignore[arg-type]
    events = [ev for chunk in chunks for ev in p.push([chunk])]
    return events + p.finish()


def joined(events: list[tuple]) -> dict[str, str]:
    out: dict[str, str] = {}
    for ev in events:
        key = ev[0] if ev[0] in ("reasoning", "content") else f"{ev[0]}{ev[1]}"
        out[key] = out.get(key, "") + (ev[-1] if ev[0] != "tool" else ev[2])
    return out


DSML = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Pa"ris\n</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">[1, {"a": null}]</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


# --- the matcher -----------------------------------------------------------------------------------------------


def test_partial_match_is_stashed_until_settled() -> None:
    m = machine((STR, "</think>", A))
    assert m.feed("ab</th") == [(U, 2)]  # "</th" may still be the marker
    assert m.feed("ink>cd") == [(A, 8), (AFTER, 2)]  # the next stage takes over
    assert m.stage_key == "t"


def test_a_failed_partial_is_released() -> None:
    m = machine((STR, "END", A))
    assert m.feed("xE") == [(U, 1)]
    assert m.feed("Nx") == [(U, 3)]
    assert m.finish() == []


def test_first_completed_match_wins_and_order_breaks_ties() -> None:
    m = machine((STR, "bcd", A), (STR, "abcde", B))
    assert m.feed("abcde") == [(U, 1), (A, 3), (AFTER, 1)]  # "bcd" completes first, though "abcde" began first
    m = machine((STR, "cd", A), (STR, "bcd", B))
    assert m.feed("bcd") == [(U, 1), (A, 2)]  # both complete on "d": the earlier branch wins


def test_newlines_before_a_marker_belong_to_it() -> None:
    m = machine((NL_STR, "</think>", A))
    assert m.feed("x\n\n") == [(U, 1)]  # the newlines wait
    assert m.feed("</think>") == [(A, 10)]
    m = machine((NL_STR, "</think>", A))
    assert m.feed("x\n\ny") == [(U, 4)]
    # a newline right after a broken partial is not counted (deepseek-recipe's automaton)
    m = machine((NL_STR, "</think>", A))
    assert m.feed("</\n</think>") == [(U, 3), (A, 8)]


def test_leading_newlines_are_dropped_one_by_one() -> None:
    stages = {"s": stage([branch(LEADING, "\n", "s", A)], U)}
    m = Machine(stages, "s")
    assert m.feed("\n\nx\n") == [(A, 1), (A, 1), (U, 2)]


def test_a_space_ends_a_parameter_name_only_after_its_closing_quote() -> None:
    stages = {"s": stage([branch(QUOTE_SPACE, " ", "t", A)], U), "t": stage([], B)}
    m = Machine(stages, "s")
    assert m.feed('"my key" string') == [(U, 8), (A, 1), (B, 6)]
    m = Machine(stages, "s")
    assert m.feed('" x"') == [(U, 4)]  # the opening quote does not count


# --- token pieces ----------------------------------------------------------------------------------------------

TABLE = TokenTable(
    token_bytes=(b"a", "😀".encode()[:2], "😀".encode()[2:], b" b", b"</", b"think", b">", b""),
    added={7: (st.THINK_END_SYM, "</think>"), 8: (st.OPAQUE_SYM, "<｜User｜>")},
    eos_ids=frozenset({9}),
)


def test_pieces_split_at_added_tokens_and_hold_broken_characters() -> None:
    d = TokenPieces(TABLE)
    assert d.feed([0, 1]) == [] and d.counts == []  # "a" waits with the half emoji
    assert d.feed([2, 3]) == ["a😀 b"] and d.counts == [4]
    assert d.feed([0, 7, 8, 0]) == ["a", (st.THINK_END_SYM, "</think>"), (st.OPAQUE_SYM, "<｜User｜>"), "a"]
    assert d.counts == [1, 1, 1, 1]
    assert d.feed([1, 8]) == ["\ufffd", (st.OPAQUE_SYM, "<｜User｜>")]  # an added token flushes, broken or not
    assert d.feed([1]) == [] and d.flush() == ["\ufffd"] and d.counts == [1]
    assert d.feed([99, 0]) == ["a"] and d.counts == [2]  # an id past the vocabulary stands for nothing


def test_token_mode_keeps_spelled_markers_as_text() -> None:
    p = OutputParser(ParsingSpec(thinking_initial_stage="reasoning_start"), token_mode=True)
    d = TokenPieces(TABLE)
    events = p.push(d.feed([0, 4, 5, 6]))  # "a</think>" from ordinary tokens: still reasoning
    events += p.push(d.feed([4]))  # a lone "</" is not held: it cannot start the real marker
    events += p.push(d.feed([7, 0]))  # the </think> token ends the reasoning
    assert events == [("reasoning", "a</think>"), ("reasoning", "</"), ("content", "a")]


# --- the parser ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_reasoning_answer_and_tool_call_at_any_chunk_size(size: int) -> None:
    text = "\n\nThinking \"hard\".\n\n</think>\n\nSure.\n\n" + DSML + "ignored"
    chunks = [text[i : i + size] for i in range(0, len(text), size)]
    events = parse(chunks, thinking_initial_stage="reasoning_start")
    got = joined(events)
    assert got["reasoning"] == 'Thinking "hard".'
    assert got["content"] == "Sure."
    assert got["tool0"] == "get_weather"
    assert json.loads(got["args0"]) == {"city": 'Pa"ris\n', "days": [1, {"a": None}]}


def test_event_granularity_follows_pieces() -> None:
    # a piece whose tail may be a marker waits whole; pieces never merge
    assert parse(["ab<", "c"], thinking_initial_stage="reasoning_start") == [("reasoning", "ab<"), ("reasoning", "c")]
    # an empty text chunk is an (empty) delta of the current kind
    assert parse(["x", ""]) == [("content", "x"), ("content", "")]


def test_v41_markup_and_parameter_names_with_spaces() -> None:
    text = DSML.replace("｜DSML｜tool_calls", "｜DSML｜ calls").replace("｜DSML｜invoke", "｜DSML｜ invoke")
    text = text.replace("｜DSML｜parameter", "｜DSML｜ parameter").replace('"city"', '"home city"')
    got = joined(parse([text]))
    assert json.loads(got["args0"]) == {"home city": 'Pa"ris\n', "days": [1, {"a": None}]}


def test_stop_sequences_end_the_answer_but_not_reasoning_or_tool_calls() -> None:
    p = OutputParser(ParsingSpec(thinking_initial_stage="reasoning_start", stop_sequences=["STOP"]))
    events = p.push(["maybe STOP here</think>Answer ST"]) + p.push(["OP more"])
    assert events == [("reasoning", "maybe STOP here"), ("content", "Answer "), ("stop", "STOP")]
    assert p.stopped and p.stop_sequence == "STOP" and p.push(["x"]) == []
    assert joined(parse([DSML.replace("Pa", "STOP")], stop_sequences=["STOP"]))["tool0"] == "get_weather"


def test_json_mode_keeps_the_json_and_blanks_the_rest() -> None:
    events = parse(['Here: ```json\n{"a": [1]}\n``` done'], parse_json_output=True)
    assert events == [("content", " "), ("content", '{"a": [1]}'), ("content", " ")]
    assert parse(['x {"a": 1}'], parse_json_output=True) == [("content", " "), ("content", "{"),
                                                            ("content", '"a": 1}')]


def test_stray_markers_in_the_answer() -> None:
    assert parse(["a</think>b <think> c"]) == [("content", "a"), ("content", "b <think> c")]
    assert parse(["x<｜DSML｜tool_calls>"], parse_tool_calls=False) == [("content", "x<｜DSML｜tool_calls>")]


def test_plain_mode_is_text_and_stop_strings_only() -> None:
    p = OutputParser(ParsingSpec(thinking_initial_stage="reasoning_start", stop_sequences=["<|im_end|>"]), plain=True)
    events = p.push(["\n\n<think>x</think>\n", "<｜DSML｜tool_calls>", "<|im_"]) + p.push(["end|>tail"])
    assert events == [("content", "\n\n<think>x</think>\n"), ("content", "<｜DSML｜tool_calls>"), ("stop", "<|im_end|>")]


def test_starts_in_tool_calls() -> None:
    text = DSML[len("<｜DSML｜tool_calls>"):]
    got = joined(parse([text], starts_in_tool_calls=True, thinking_initial_stage="reasoning_start"))
    assert "reasoning" not in got and json.loads(got["args0"])["days"] == [1, {"a": None}]


def test_escaping() -> None:
    assert json_escape('a"b\\c\n\x01é😀') == 'a\\"b\\\\c\\n\\u0001é😀'
    assert key_escape('"a\\b\x1f"') == '"a\\\\b\\u001f"'  # its own quotes stay
    assert key_escape('"plain"') == '"plain"'
