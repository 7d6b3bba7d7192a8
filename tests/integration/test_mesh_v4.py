"""A DeepSeek-V4 checkpoint served through the whole mesh: `deepinfer up --model DIR` on a tiny random V4
checkpoint with the real vocabulary (129,280), a 4,096-token context and 128-token long-term blocks.

Random weights say random things, so nothing here reads the text: only its structure, that the same greedy or
seeded request gives the same tokens every way it is asked, and token counts, which must equal what
deepseek-recipe (the oracle, see tests/oracle/) makes of the same request body. A forced tool choice makes
random weights write DSML calls (the grammar, prefill's first token and decode's rest), which must parse and whose
arguments must validate.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

dr = pytest.importorskip("deepseek_recipe")

from tests import v4_checkpoints  # noqa: E402
from tests.integration.mesh import Mesh, start_mesh  # noqa: E402
from tests.oracle.conftest import oracle_convert, oracle_encoder  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = v4_checkpoints.SERVED_NAME
BLOCK = 128  # engine.block_tokens of this checkpoint: lcm(16, its compress ratios 4 and 128)
CONFIG = {**v4_checkpoints.BASE, **v4_checkpoints.CONFIGS["mixed"]}
# Bounded replay recomputes at most this many tokens before a restored prefix (the sliding-window cone)
REPLAY_BOUND = CONFIG["num_hidden_layers"] * CONFIG["sliding_window"]
NO_THINKING = {"thinking": {"type": "disabled"}}
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather.",
                                               "parameters": PARAMETERS}}]
STORY = " ".join(f"Sentence number {i} says that the sky was blue on day {i}." for i in range(30))
LONG = {"model": MODEL, "messages": [{"role": "user", "content": STORY + " What colour was the sky?"}],
        "temperature": 0.0, "max_tokens": 6, "extra_body": NO_THINKING}
ANSWERS: list[str] = []  # LONG's answer, to compare after the restart


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return v4_checkpoints.build_served(tmp_path_factory.mktemp("v4-ckpt"))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[Mesh]:
    mesh = start_mesh(tmp_path_factory.mktemp("v4-mesh"), "--model", str(checkpoint))
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def oai(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="test-key", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(mesh: Mesh) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=mesh.base_url, api_key="test-key", max_retries=0, timeout=120)


def oracle_tokens(api: str, kwargs: dict[str, Any]) -> int:
    """Prompt tokens of the body an SDK sends for `kwargs`, as deepseek-recipe renders and encodes it (V4)."""
    body = {k: v for k, v in kwargs.items() if k != "extra_body"} | kwargs.get("extra_body", {})
    kind, converted = oracle_convert(api, json.dumps(body, ensure_ascii=False).encode())
    assert kind == "ok", converted
    return len(oracle_encoder().encode(converted.conversation))


def reasoning_of(message: Any) -> str:
    return (message.model_extra or {}).get("reasoning_content") or ""


# Thinking mode samples at temperature 1 whatever the request says (as DeepSeek's API does): a seed makes it
# repeatable. Without thinking, temperature 0 is greedy.
MODES = {"thinking-seeded": {"seed": 7}, "greedy": {"extra_body": NO_THINKING},
         "seeded": {"temperature": 0.9, "seed": 7, "extra_body": NO_THINKING}}


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_chat_streaming_equals_non_streaming(oai: openai.OpenAI, mode: dict[str, Any]) -> None:
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 12,
           "temperature": 0.0, **mode}
    reply = oai.chat.completions.create(**ask)
    message = reply.choices[0].message
    # text came back, in the channel the mode starts in
    assert message.content if "extra_body" in mode else reasoning_of(message)
    usage = reply.usage
    assert usage.prompt_tokens == oracle_tokens("chat", ask)
    assert 0 < usage.completion_tokens <= 12 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    chunks = list(oai.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == (message.content or "")
    assert "".join(reasoning_of(d) for d in deltas) == reasoning_of(message)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        reply.choices[0].finish_reason]
    assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens
    assert oai.chat.completions.create(**ask).choices[0].message == message  # the same tokens, asked again


@pytest.mark.parametrize("mode", [MODES["thinking-seeded"], MODES["greedy"]], ids=["thinking-seeded", "greedy"])
def test_logprobs_in_chat_and_responses(oai: openai.OpenAI, mode: dict[str, Any]) -> None:
    """DeepSeek's formats through prefill and decode: reasoning tokens under `reasoning_content` (the reference's
    key), answer tokens under `content`, each with its alternatives most likely first; streamed as returned."""
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 10,
           "temperature": 0.0, "logprobs": True, "top_logprobs": 2, **mode}
    reply = oai.chat.completions.create(**ask)
    lp = reply.choices[0].logprobs
    entries = {"content": lp.content or [], "reasoning_content": (lp.model_extra or {}).get("reasoning_content") or []}
    channel = "content" if "extra_body" in mode else "reasoning_content"
    assert entries[channel]
    for e in entries["content"] + [openai.types.chat.ChatCompletionTokenLogprob(**x)
                                   for x in entries["reasoning_content"]]:
        assert bytes(e.bytes).decode("utf-8", "replace") and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob and e.logprob <= e.top_logprobs[0].logprob
        if "extra_body" in mode:  # greedy: the chosen token is the most likely one
            assert (e.token, e.logprob) == (e.top_logprobs[0].token, e.top_logprobs[0].logprob)
    streamed: dict[str, list] = {"content": [], "reasoning_content": []}
    for chunk in oai.chat.completions.create(**ask, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            got = chunk.choices[0].logprobs.model_dump()
            for key in streamed:
                streamed[key] += got.get(key) or []
    assert streamed["content"] == [e.model_dump() for e in entries["content"]]
    assert streamed["reasoning_content"] == entries["reasoning_content"]
    if "extra_body" in mode:
        response = oai.responses.create(model=MODEL, input="Name three colors.", max_output_tokens=10,
                                        temperature=0.0, top_logprobs=2, reasoning={"effort": "none"})
        part = response.output[-1].content[0]
        assert [(x.token, x.logprob) for x in part.logprobs] == [(e.token, e.logprob) for e in entries["content"]]


def test_a_reasoning_budget_closes_the_reasoning_and_the_answer_follows(oai: openai.OpenAI) -> None:
    """thinking.budget_tokens 3: the engine forces </think> at output position 3 (prefill samples position 0, decode
    the rest), so the reasoning is the unbudgeted run's first 3 tokens (the same seed, the same draws) and the
    answer follows it; streamed as returned."""
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 10,
           "logprobs": True, "seed": 7}

    def entries(reply: Any) -> tuple[list[str], list[str]]:
        lp = reply.choices[0].logprobs
        return ([x["token"] for x in (lp.model_extra or {}).get("reasoning_content") or []],
                [e.token for e in lp.content or []])

    free_reasoning, _ = entries(oai.chat.completions.create(**ask))
    budget = {"extra_body": {"thinking": {"type": "enabled", "budget_tokens": 3}}}
    reply = oai.chat.completions.create(**ask, **budget)
    reasoning, answer = entries(reply)
    assert len(free_reasoning) > 3 and reasoning == free_reasoning[:3]
    assert answer and reply.choices[0].message.content  # the answer came after the forced end of the reasoning
    streamed = list(oai.chat.completions.create(**ask, **budget, stream=True))
    assert "".join(reasoning_of(c.choices[0].delta) for c in streamed if c.choices) == reasoning_of(
        reply.choices[0].message)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == reply.choices[0].message.content


def test_repeated_long_prompt_restores_its_blocks(oai: openai.OpenAI, mesh: Mesh) -> None:
    first, second = oai.chat.completions.create(**LONG), oai.chat.completions.create(**LONG)
    n = first.usage.prompt_tokens
    assert n > 2 * BLOCK and second.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details.cached_tokens < BLOCK  # at most the preamble the earlier tests share
    restored = (n - 1) // BLOCK * BLOCK  # whole blocks before the last prompt token, whose logits are computed
    assert restored - REPLAY_BOUND <= second.usage.prompt_tokens_details.cached_tokens < restored
    assert second.choices[0].message.content == first.choices[0].message.content
    ANSWERS.append(first.choices[0].message.content)
    # Decode took every prompt block, the partial tail block and the short-term state from the kvcache service.
    assert "recomputing" not in (mesh.state_dir / "logs" / "decode-0.log").read_text()


def test_openai_tool_call_round_trip(oai: openai.OpenAI) -> None:
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": OAI_TOOLS,
           "max_tokens": 8, "temperature": 0.0}
    raw = oai.chat.completions.with_raw_response.create(**ask)
    assert raw.status_code == 200
    assert raw.parse().usage.prompt_tokens == oracle_tokens("chat", ask)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    counts = []
    for result in ("sunny", "sunny, 24 degrees, light wind from the west, no rain expected before Friday"):
        history = [*ask["messages"],
                   {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": result}]
        body = {**ask, "messages": history}
        reply = oai.chat.completions.create(**body)
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert reply.usage.prompt_tokens == oracle_tokens("chat", body)
        counts.append(reply.usage.prompt_tokens)
    assert counts[1] > counts[0]  # the tool's result is part of the prompt


def test_anthropic_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    tools = [{"name": "get_weather", "description": "Current weather.", "input_schema": PARAMETERS}]
    ask = {"model": MODEL, "max_tokens": 8, "tools": tools,
           "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    first = claude.messages.create(**ask, extra_body={"temperature": 0})
    assert first.stop_reason in ("end_turn", "max_tokens", "tool_use") and first.usage.output_tokens > 0
    counts = []
    for result in ("sunny", "sunny, 24 degrees, light wind from the west, no rain expected before Friday"):
        messages = [*ask["messages"],
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]}]
        body = {**ask, "messages": messages}
        expected = oracle_tokens("messages", body)
        counted = claude.messages.count_tokens(model=MODEL, tools=tools, messages=messages)
        assert counted.input_tokens == expected
        reply = claude.messages.create(**body, extra_body={"temperature": 0})
        assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == expected
        assert reply.content and reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
        counts.append(expected)
    assert counts[1] > counts[0]


# --- tool calls under a grammar (random weights: only the constraint makes them calls) --------------------------

BOUNDED = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
FORCED = [{"type": "function", "function": {"name": "forecast", "parameters": BOUNDED, "strict": True}},
          {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]


def _calls_validate(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), BOUNDED)


@pytest.mark.parametrize("choice, mode", [("required", MODES["greedy"]),
                                          ({"type": "function", "function": {"name": "forecast"}}, MODES["seeded"])],
                         ids=["required-greedy", "named-seeded"])
def test_a_forced_tool_call_parses_and_validates_streaming_and_not(oai: openai.OpenAI, choice: Any,
                                                                    mode: dict[str, Any]) -> None:
    tools = FORCED[:1] if choice == "required" else FORCED
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
           "tool_choice": choice, "parallel_tool_calls": False, "max_tokens": 120, "temperature": 0.0, **mode}
    reply = oai.chat.completions.create(**ask).choices[0]
    assert reply.finish_reason == "tool_calls", reply.message
    calls = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls]
    assert len(calls) == 1  # parallel_tool_calls false: one call, whatever random weights would add
    _calls_validate(calls, {"forecast"})
    streamed: dict[int, list[str]] = {}
    for chunk in oai.chat.completions.create(**ask, stream=True):
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            parts = streamed.setdefault(call.index, ["", ""])
            parts[0] += (call.function.name or "") if call.function else ""
            parts[1] += (call.function.arguments or "") if call.function else ""
    assert [tuple(p) for _, p in sorted(streamed.items())] == calls  # the same tokens, any chunking


def test_anthropic_any_and_auto_with_thinking(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    tools = [{"name": "forecast", "description": "Forecast.", "input_schema": BOUNDED}]
    ask = {"model": MODEL, "max_tokens": 120, "tools": tools,
           "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
           "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    reply = claude.messages.create(**ask, extra_body={"temperature": 0, **NO_THINKING})
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and len(uses) == 1
    _calls_validate([(u.name, json.dumps(u.input)) for u in uses], {"forecast"})
    # thinking (V4's default): the reasoning stays free, and the answer after it is text or a call that validates
    auto = {"model": MODEL, "messages": ask["messages"], "tools": FORCED[:1], "max_tokens": 60, "seed": 5}
    message = oai.chat.completions.create(**auto).choices[0].message
    assert reasoning_of(message) or message.content or message.tool_calls
    for call in message.tool_calls or []:
        _calls_validate([(call.function.name, call.function.arguments)], {"forecast"})
    empty_range = {"type": "object", "properties": {"q": {"type": "integer", "minimum": 5, "maximum": 1}}}
    with pytest.raises(openai.BadRequestError, match="tool 'forecast'"):  # a valid schema xgrammar cannot compile
        oai.chat.completions.create(**{**auto, "tools": [{"type": "function", "function": {
            "name": "forecast", "parameters": empty_range}}]})


def test_responses_api(oai: openai.OpenAI) -> None:
    body = {"model": MODEL, "input": "What is the capital of France?", "max_output_tokens": 8, "temperature": 0.0,
            "reasoning": {"effort": "none"}}
    response = oai.responses.create(**body)
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.usage.input_tokens == oracle_tokens("responses", body)
    assert 0 < response.usage.output_tokens <= 8
    events = list(oai.responses.create(**body, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    done = events[-1].response
    assert done.usage.input_tokens == response.usage.input_tokens
    assert done.usage.output_tokens == response.usage.output_tokens


def test_a_follow_up_turn_resumes_from_the_previous_turns_end(oai: openai.OpenAI) -> None:
    """The decode worker stores the output's blocks and a snapshot (partial block + rings) at its end, before the
    answer ends; the next turn, whose prompt starts with the whole first turn and is sent the moment the first
    answer ends (an agent's next call), computes only what is new. The answer's ids come back through logprobs
    spelled as ids (vLLM's return_tokens_as_token_ids)."""
    import random

    rng = random.Random(5)
    turn1 = [rng.randrange(1000, 100_000) for _ in range(300)]
    first = oai.completions.create(model=MODEL, prompt=turn1, max_tokens=20, temperature=0.0, logprobs=0,
                                   extra_body={"return_tokens_as_token_ids": True})
    assert first.choices[0].logprobs is not None
    output = [int(t.removeprefix("token_id:")) for t in first.choices[0].logprobs.tokens]
    assert len(output) == first.usage.completion_tokens > 1
    follow = turn1 + output + [rng.randrange(1000, 100_000) for _ in range(30)]
    second = oai.completions.create(model=MODEL, prompt=follow, max_tokens=4, temperature=0.0)
    # everything up to the first turn's last token (sampled, never computed) came back from the snapshot
    assert second.usage.prompt_tokens_details.cached_tokens == len(turn1) + len(output) - 1


def test_after_a_restart_prefill_restores_the_prompt_from_the_kvcache_service(mesh: Mesh, checkpoint: Path) -> None:
    """Runs last: restart the mesh on its state. Prefill's own cache is empty now; the long prompt's blocks come
    from the kvcache service's store, and prefill replays only a bounded window to rebuild the short-term state."""
    assert mesh.stop() == 0
    again = start_mesh(mesh.state_dir, "--model", str(checkpoint))
    try:
        oai = openai.OpenAI(base_url=f"{again.base_url}/v1", api_key="test-key", max_retries=0, timeout=120)
        reply = oai.chat.completions.create(**LONG)
        n = reply.usage.prompt_tokens
        restored = (n - 1) // BLOCK * BLOCK
        assert restored - REPLAY_BOUND <= reply.usage.prompt_tokens_details.cached_tokens < restored
        assert [reply.choices[0].message.content] == ANSWERS
    finally:
        again.stop()

