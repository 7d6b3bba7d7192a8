"""The output side against deepseek-recipe 0.2.0 (the oracle): the same generated output, cut at random chunk
boundaries, through both stream processors must give identical stream events (per push) and identical
complete responses, for Chat Completions, Anthropic Messages and Responses, from text chunks and from token
id chunks. Ids and timestamps are normalised; everything else is compared byte for byte.

Outputs are model-like: reasoning, answer text full of near-markers (`<`, `</`, `｜`, fences, stop-string
prefixes, a stray `</think>`), JSON answers, DSML tool calls in V4 and V4.1 spelling with string arguments
(quotes, backslashes, newlines, control characters, emoji) and JSON arguments (nested, unicode, odd numbers),
then maybe cut short (max_tokens) anywhere. Documented deviations (test_output_oracle_deviations.py) are kept
out: parameter names here have no spaces, and token outputs never end inside a character.

The PreparedRequest comes from the oracle's own conversion of the request (its parsing options and, for
Responses, the settings its response reports), so this tests the output side alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import tokenizers

dr = pytest.importorskip("deepseek_recipe")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from services.recipe.emit import End, OutputProcessor, Ready, Text, Tokens  # noqa: E402
from services.recipe.parse import TokenTable  # noqa: E402
from services.recipe.prepared import InferenceSpec, ParsingSpec, PreparedRequest  # noqa: E402
from shared.deepseek_tokenizer import deepseek_tokenizer_dir, load_deepseek_tokenizer  # noqa: E402
from shared.schemas.generate import TokenLogprob  # noqa: E402

TK = dr.Tokenizer.from_file(str(deepseek_tokenizer_dir() / "tokenizer.json"))
OUR_TOKENIZER = load_deepseek_tokenizer()
TABLE = TokenTable.from_tokenizer(OUR_TOKENIZER)
REQUESTS = {"chat": dr.ChatCompletionRequest, "messages": dr.MessagesRequest, "responses": dr.ResponsesRequest}
RESPONSES = {"chat": dr.ChatCompletionResponse, "messages": dr.MessagesResponse, "responses": dr.ResponsesResponse}
FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length,
          "content_filter": dr.InferenceFinishReason.ContentFilter}
STAGES = {"ReasoningStart": "reasoning_start", "ReasoningContinuation": "reasoning_continuation",
          "ContentContinuation": "content_continuation"}
ECHO_KEYS = ("instructions", "max_output_tokens", "reasoning", "temperature", "text", "tool_choice", "tools",
             "top_logprobs", "top_p", "user")
NORMALISE = [(re.compile(r'"(created|created_at|completed_at)":\d+'), r'"\1":0'),
             (re.compile(r"call_\d\d_[A-Za-z0-9_-]+"), "call_ID")]
USAGE = (1234, 321)  # prompt tokens, of which read from the cache
SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# each logprob example spells every token's alternatives on both sides (about 60 ms a case on the CI's CPU): fewer
LOGPROB_SETTINGS = settings(SETTINGS, max_examples=60)


def normalise(text: str) -> str:
    for pattern, replacement in NORMALISE:
        text = pattern.sub(replacement, text)
    return text


def count_tokens(text: str) -> int:
    return len(OUR_TOKENIZER.encode(text))


def _plain_tokenizer() -> tokenizers.Tokenizer:
    config = json.loads((deepseek_tokenizer_dir() / "tokenizer.json").read_text())
    config["added_tokens"] = []
    return tokenizers.Tokenizer.from_str(json.dumps(config))


PLAIN = _plain_tokenizer()  # the vocabulary without added tokens: "</think>" is "</", "think", ">"


def plain_ids(text: str) -> list[int]:
    return PLAIN.encode(text, add_special_tokens=False).ids


# --- outputs ---------------------------------------------------------------------------------------------------

NOISE = ["Hello", " world", "\n", "\n\n", "<", "</", "</think>", "<think>", "｜", "<｜DSML｜", "</｜DSML｜", "END",
         "EN", "`", "```", "```json\n", "\n```", "{", "}", "[", "]", '"', " ", "é", "😀", "a", "\\", "\t", "中文",
         "<｜User｜>", "\x01", "tool_calls>", "true\">"]
STRING_BITS = ["a", " ", '"', "\\", "\n", "\t", "\x01", "\x1f", "é", "😀", "中", "<", "</x>", "/", "｜", "END", "&lt;",
               "{", "}"]
ODD_NUMBERS = ["1e5", "-0.0", "2.50", "1E+2", "12345678901234567890", "123456789012345678901234", "0.1", "-7"]
KEYS = ["city", "n", "x_y", "ключ", "a1", "日本", "days"]
TOOL_NAMES = ["get_weather", "f", "lookup"]

noise = st.lists(st.sampled_from(NOISE), max_size=8).map("".join)
string_value = st.lists(st.sampled_from(STRING_BITS), max_size=8).map("".join)
json_leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
             | st.floats(allow_nan=False, allow_infinity=False) | st.text(st.sampled_from("ab\"\\\né😀<"), max_size=4))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.sampled_from(["k", "é", "a b", "z"]), inner, max_size=3), max_leaves=6)


@st.composite
def json_text(draw: st.DrawFn) -> str:
    if draw(st.integers(0, 4)) == 0:
        return draw(st.sampled_from(ODD_NUMBERS))
    spaced = draw(st.booleans())
    return json.dumps(draw(json_value), ensure_ascii=draw(st.booleans()),
                      separators=(", ", ": ") if spaced else (",", ":"))


@st.composite
def dsml_block(draw: st.DrawFn) -> str:
    prefix = " " if draw(st.booleans()) else ""  # V4.1 writes `<｜DSML｜ invoke`; both parse either way
    block = " calls" if prefix else "tool_calls"
    out = [f"<｜DSML｜{block}>\n"]
    for _ in range(draw(st.integers(1, 3))):
        out.append(f'<｜DSML｜{prefix}invoke name="{draw(st.sampled_from(TOOL_NAMES))}">\n')
        for _ in range(draw(st.integers(0, 3))):
            key = draw(st.sampled_from(KEYS))
            if draw(st.booleans()):
                value, string = draw(string_value), "true"
            else:
                value, string = draw(json_text()), "false"
            out.append(f'<｜DSML｜{prefix}parameter name="{key}" string="{string}">{value}</｜DSML｜{prefix}parameter>\n')
        out.append(f"</｜DSML｜{prefix}invoke>\n")
    out.append(f"</｜DSML｜{block}>")
    return "".join(out)


@st.composite
def output(draw: st.DrawFn, reasoning: bool, tools: bool, json_mode: bool) -> list[tuple[str, bool]]:
    """The output as (text, is markup) parts: as token ids, markup is encoded with the added vocabulary (the
    model writes `</think>` as one token) and the rest without it (so noise spells markers with ordinary
    tokens, which must stay text)."""
    parts: list[tuple[str, bool]] = []
    if reasoning and draw(st.integers(0, 5)):
        parts += [(draw(noise), False),
                  (draw(st.sampled_from(["</think>", "\n\n</think>\n\n", "</think>\n", "\n</think>"])), True)]
    parts.append((draw(noise), False))
    if json_mode and draw(st.booleans()):
        fence = draw(st.sampled_from(["```json\n", "```\n", ""]))
        parts.append((fence + draw(json_text()) + ("\n```" if fence else "") + draw(noise), False))
    if tools and draw(st.booleans()):
        parts.append((draw(st.sampled_from(["", "\n", "\n\n"])) + draw(dsml_block()), True))
        if draw(st.integers(0, 3)) == 0:
            parts.append((draw(noise), False))  # text after the tool calls: dropped by both
    return parts


def cut(draw: st.DrawFn, items: Any) -> Any:
    """Maybe cut short, anywhere (max_tokens)."""
    return items[: draw(st.integers(0, len(items)))] if draw(st.integers(0, 3)) == 0 else items


# --- requests --------------------------------------------------------------------------------------------------

STOPS = ["END", "EN", "</", "\n\n", "a", "DSML", '"', "😀"]


@st.composite
def request(draw: st.DrawFn) -> tuple[str, dict[str, Any], bool, bool, bool]:
    """(api, body, reasoning expected first, tools offered, JSON mode)."""
    api = draw(st.sampled_from(["chat", "messages", "responses"]))
    model = draw(st.sampled_from(["DeepSeek-V4-Pro", "DeepSeek-V4.1-Flash"]))
    thinking, tools = draw(st.booleans()), draw(st.booleans())
    json_mode = api in ("chat", "responses") and not tools and draw(st.integers(0, 2)) == 0
    stream = draw(st.booleans())
    reasoning = thinking
    if api == "chat":
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi, answer in json"}]
        body: dict[str, Any] = {"model": model, "messages": messages, "stream": stream,
                                "thinking": {"type": "enabled" if thinking else "disabled"}}
        if stream and draw(st.booleans()):
            body["stream_options"] = {"include_usage": True}
        if tools:
            body["tools"] = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                             for n in TOOL_NAMES]
            if not thinking and draw(st.integers(0, 3)) == 0:
                body["tool_choice"] = "required"
        if json_mode:
            body["response_format"] = {"type": "json_object"}
        # prefix continuation, of the answer or of the reasoning (the oracle refuses it with tools or JSON)
        if not json_mode and not tools and draw(st.integers(0, 4)) == 0:
            content = draw(st.sampled_from(["pre", ""]))
            messages.append({"role": "assistant", "content": content, "prefix": True,
                             **({"reasoning_content": "r"} if thinking else {})})
            reasoning = thinking and not content
        stops = draw(st.lists(st.sampled_from(STOPS), max_size=3, unique=True))
        if stops:
            body["stop"] = stops
    elif api == "messages":
        body = {"model": model, "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
                "thinking": {"type": "enabled", "budget_tokens": 500} if thinking else {"type": "disabled"}}
        if tools:
            body["tools"] = [{"name": n, "input_schema": {"type": "object"}} for n in TOOL_NAMES]
        stops = draw(st.lists(st.sampled_from(STOPS), max_size=3, unique=True))
        if stops:
            body["stop_sequences"] = stops
    else:
        body = {"model": model, "input": "hi, answer in json", "stream": stream,
                "reasoning": {"effort": draw(st.sampled_from(["high", "low"]))} if thinking else {"effort": "none"}}
        if tools:
            body["tools"] = [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in TOOL_NAMES]
        if json_mode:
            body["text"] = {"format": {"type": "json_object"}}
    return api, body, reasoning, tools, json_mode


# --- both processors -------------------------------------------------------------------------------------------


def run_oracle(api: str, body: dict[str, Any], chunks: list[Any], finish: str | None,
               logprobs: list[list[TokenLogprob]] | None = None) -> tuple[list, str, dict]:
    req = REQUESTS[api](body)
    extra: dict[str, Any] = {}
    if api == "responses":
        extra["namespace_tool_map"] = req.namespace_tool_map(dr.ConversionOptions())
        echo = req.echo()
    converted = req.convert(dr.ConversionOptions())
    generator = REQUESTS[api].chunk_generator(converted, "ID", body["model"])
    if api == "responses":
        generator = generator.with_namespace_tool_map(extra["namespace_tool_map"]).with_echo(echo)
    sp = dr.StreamProcessor(generator, converted.parsing_options, TK)
    pushes = [sp.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(
        prompt_tokens=USAGE[0], prompt_cache_hit_tokens=USAGE[1])))]
    for i, chunk in enumerate(chunks):
        if sp.finished:
            break
        if isinstance(chunk, str):
            pushes.append(sp.push(dr.InferenceChunk.text(chunk, 1)))
        elif logprobs is None:
            pushes.append(sp.push(dr.InferenceChunk.tokens(chunk)))
        else:
            pairs = [(lp.logprob, list(zip(lp.top_ids, lp.top_logprobs))) for lp in logprobs[i]]
            pushes.append(sp.push(dr.InferenceChunk.tokens(chunk, pairs)))
    if finish is not None and not sp.finished:
        pushes.append(sp.push(dr.InferenceChunk.finish(FINISH[finish])))
    pushes.append(sp.finish() if not sp.finished else [])
    events = [[(RESPONSES[api].sse_event_name(e), normalise(e.to_json())) for e in push] for push in pushes]
    po = converted.parsing_options
    stage = po.thinking_initial_stage
    spec = ParsingSpec(parse_tool_calls=po.parse_tool_calls, starts_in_tool_calls=po.starts_in_tool_calls,
                       parse_json_output=po.parse_json_output,
                       thinking_initial_stage=None if stage is None else STAGES[str(stage).split(".")[-1]],
                       stop_sequences=list(po.stop_sequences))
    info: dict[str, Any] = {"spec": spec, "extra": extra, "echo": {}}
    if api == "responses":
        info["echo"] = {k: json.loads(pushes[0][0].to_json())["response"][k] for k in ECHO_KEYS}
    response = RESPONSES[api]("ID", body["model"], 0, *USAGE)
    for push in pushes:
        for e in push:
            response.accumulate(e)
    return events, normalise(response.to_json()), info


def run_ours(api: str, body: dict[str, Any], info: dict, chunks: list[Any], finish: str | None,
             tokens: bool, logprobs: list[list[TokenLogprob]] | None = None) -> tuple[list, str]:
    stream_options = body.get("stream_options") or {}
    prepared = PreparedRequest(
        api=api, model=body["model"], encoding="v4", stream=bool(body.get("stream")),
        include_usage=bool(stream_options.get("include_usage")), conversation=None,
        inference=InferenceSpec(None, None, None), parsing=info["spec"], echo=info["echo"], extra=info["extra"])
    p = OutputProcessor(prepared, response_id="ID", created=0, tokens=TABLE if tokens else None,
                        count_tokens=count_tokens)
    pushes = [p.push(Ready(*USAGE))]
    for i, chunk in enumerate(chunks):
        if p.done:
            break
        lps = None if logprobs is None else logprobs[i]
        pushes.append(p.push(Text(chunk, 1) if isinstance(chunk, str) else Tokens(chunk, lps)))
    if finish is not None and not p.done:
        pushes.append(p.push(End(finish)))  # type: ignore[arg-type]
    pushes.append(p.finish())
    events = [[(name, normalise(data.decode())) for name, data in push] for push in pushes]
    return events, normalise(p.body().decode())


def compare(api: str, body: dict[str, Any], chunks: list[Any], finish: str | None, tokens: bool,
            logprobs: list[list[TokenLogprob]] | None = None) -> None:
    o_events, o_body, info = run_oracle(api, body, chunks, finish, logprobs)
    u_events, u_body = run_ours(api, body, info, chunks, finish, tokens, logprobs)
    if body.get("stream"):
        assert len(u_events) == len(o_events)
        for i, (ours, oracle) in enumerate(zip(u_events, o_events)):
            assert ours == oracle, f"push {i} ({chunks[i - 1] if 0 < i <= len(chunks) else 'end'!r})"
    assert u_body == o_body


def split(draw: st.DrawFn, items: Any, max_cuts: int = 12) -> list[Any]:
    cuts = sorted(draw(st.lists(st.integers(0, len(items)), max_size=max_cuts)))
    bounds = [0, *cuts, len(items)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


# --- tests -----------------------------------------------------------------------------------------------------


@SETTINGS
@given(st.data())
def test_text_chunks_match_the_oracle(data: st.DataObject) -> None:
    api, body, reasoning, tools, json_mode = data.draw(request())
    text = cut(data.draw, "".join(text for text, _ in data.draw(output(reasoning, tools, json_mode))))
    chunks = split(data.draw, text)  # empty chunks included: they are events too
    finish = data.draw(st.sampled_from(["stop", "length", "content_filter", None]))
    compare(api, body, chunks, finish, tokens=False)


def _whole_characters(ids: list[int]) -> list[int]:
    """Drop trailing ids that end inside a UTF-8 character (the oracle loses the text held with them; see the
    deviation tests)."""
    while ids:
        held = b"".join(TABLE.token_bytes[i] for i in ids[-4:] if i not in TABLE.added)
        if not held.decode("utf-8", "replace").endswith("\ufffd") or ids[-1] in TABLE.added:
            break
        ids = ids[:-1]
    return ids


@SETTINGS
@given(st.data())
def test_token_chunks_match_the_oracle(data: st.DataObject) -> None:
    api, body, reasoning, tools, json_mode = data.draw(request())
    parts = data.draw(output(reasoning, tools, json_mode))
    ids = [i for text, markup in parts for i in (TK.encode(text) if markup else plain_ids(text))]
    ids = _whole_characters(cut(data.draw, ids))  # cut between tokens, maybe inside a character
    chunks = [c for c in split(data.draw, ids) if c]
    finish = data.draw(st.sampled_from(["stop", "length", "content_filter", None]))
    compare(api, body, chunks, finish, tokens=True)


# Logprobs as the engine makes them (f32 values, the most likely first), and the odd ones: tiny (a near-certain
# token), huge, zero, -inf; top ids anywhere in the vocabulary: added tokens, ids that cut a character, ids
# past the vocabulary (padded logits).
LOGPROB = (st.floats(-40.0, 0.0, width=32) | st.sampled_from([-0.0, -1.1920929e-07, -2.3841858e-06, -1e-06, -5e-08,
                                                             -1e13, -9999.0, float("-inf")]))
SPECIAL_IDS = sorted(TABLE.added)[:64]
TOP_ID = st.integers(0, len(TABLE.token_bytes) + 8) | st.sampled_from(SPECIAL_IDS) | st.sampled_from([53769, 225])


@st.composite
def token_logprob(draw: st.DrawFn, tid: int) -> TokenLogprob:
    top = sorted(draw(st.lists(LOGPROB, max_size=3)), reverse=True)
    ids = draw(st.lists(TOP_ID, min_size=len(top), max_size=len(top)))
    if top and draw(st.booleans()):
        ids[0] = tid  # greedy: the sampled id is the most likely one
    return TokenLogprob(draw(LOGPROB), ids, top)


@LOGPROB_SETTINGS
@given(st.data())
def test_token_chunks_with_logprobs_match_the_oracle(data: st.DataObject) -> None:
    """Each text delta carries its tokens' entries (Chat's `content` / `reasoning_content`, Responses' output
    text deltas and parts, none for Messages), exactly as the oracle writes them."""
    api, body, reasoning, tools, json_mode = data.draw(request())
    if api == "chat":
        body |= {"logprobs": True, "top_logprobs": 3}
    elif api == "responses":
        body["top_logprobs"] = 3
    parts = data.draw(output(reasoning, tools, json_mode))
    ids = [i for text, markup in parts for i in (TK.encode(text) if markup else plain_ids(text))]
    ids = _whole_characters(cut(data.draw, ids))
    chunks = [c for c in split(data.draw, ids) if c]
    logprobs = [[data.draw(token_logprob(t)) for t in chunk] for chunk in chunks]
    finish = data.draw(st.sampled_from(["stop", "length", "content_filter", None]))
    compare(api, body, chunks, finish, tokens=True, logprobs=logprobs)


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [True, False])
def test_logprobs_of_reasoning_json_and_a_split_character(api: str, stream: bool) -> None:
    """The cases the generated ones may miss: reasoning then an answer, a JSON answer that one piece cuts into
    three deltas (the oracle repeats the piece's entries on each), an emoji split over two tokens."""
    body: dict[str, Any] = {"model": "DeepSeek-V4-Pro", "stream": stream}
    if api == "chat":
        body |= {"messages": [{"role": "user", "content": "hi json"}], "logprobs": True, "top_logprobs": 2}
    else:
        body |= {"input": "hi json", "top_logprobs": 2, "reasoning": {"effort": "high"}}
    ids = plain_ids("ab\n\n") + TK.encode("</think>") + plain_ids("\n\nSure {\"a\": 1} \U0001F600 bye")
    lps = [TokenLogprob(-0.25 * (i + 1), [t, 7], [-0.25 * (i + 1), -3.5]) for i, t in enumerate(ids)]
    for size in (1, 2, len(ids)):
        chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
        compare(api, body, chunks, "stop", tokens=True,
                logprobs=[lps[i : i + size] for i in range(0, len(ids), size)])
    json_body = {**body, **({"response_format": {"type": "json_object"}, "thinking": {"type": "disabled"}}
                            if api == "chat" else {"text": {"format": {"type": "json_object"}},
                                                   "reasoning": {"effort": "none"}})}
    answer = plain_ids("Sure {\"a\": 1} bye")
    compare(api, json_body, [answer], "stop", tokens=True, logprobs=[lps[: len(answer)]])


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
@pytest.mark.parametrize("stream", [True, False])
def test_reasoning_answer_and_two_tool_calls(api: str, stream: bool) -> None:
    text = ('Let me check the weather "first".\n\n</think>\n\nSure, checking 😀.\n\n<｜DSML｜tool_calls>\n'
            '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Paris "x"\n日本'
            '</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">{"a": [1, 2.50, true]}'
            '</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n'
            "</｜DSML｜tool_calls>")
    tools = {"chat": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
             "messages": [{"name": "get_weather", "input_schema": {"type": "object"}}],
             "responses": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]}[api]
    body: dict[str, Any] = {"model": "DeepSeek-V4-Pro", "stream": stream, "tools": tools}
    if api == "responses":
        body["input"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    if api == "messages":
        body |= {"max_tokens": 100, "thinking": {"type": "enabled", "budget_tokens": 50}}
    for size in (1, 3, 7, len(text)):
        compare(api, body, [text[i : i + size] for i in range(0, len(text), size)], "stop", tokens=False)
    ids = TK.encode(text)
    compare(api, body, [[i] for i in ids], "stop", tokens=True)
