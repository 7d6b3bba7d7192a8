"""The clients people point at a vLLM server, unchanged, against the whole mesh: each finishes at its limit.

LangChain's ChatOpenAI sends `max_completion_tokens` (also for `max_tokens=`), LiteLLM, guidellm and `vllm bench
serve` send their own bodies (copied here from their request builders: guidellm's openai request handlers, vLLM's
benchmarks/lib/endpoint_request_func.py), benchmarks with `ignore_eos: true`. With ignore_eos the answer must
be exactly the limit long; without it, at most the limit. Fields we do not honour get a 400 naming them;
logit_bias and the presence / frequency penalties change the answer.
Past the recipe's bound on requests in flight (`--max-queued-requests`, small here) every client gets a 429 it
knows, with Retry-After, while the requests admitted finish.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from tests.integration.mesh import Mesh, start_mesh

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
STORY = "Write a long story about a dragon who learns to bake bread."
HI = "Say hi."  # answered in 24 tokens, greedy
LIMIT = 40
MAX_QUEUED = 3  # this module's requests run one at a time, but the overload case


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    mesh = start_mesh(tmp_path_factory.mktemp("mesh"), "--max-queued-requests", str(MAX_QUEUED))
    yield mesh
    mesh.stop()


def test_langchain_chat_openai_honours_its_limits(mesh: Mesh) -> None:
    from langchain_openai import ChatOpenAI

    common: dict[str, Any] = {"model": MODEL, "base_url": f"{mesh.base_url}/v1", "api_key": "k", "temperature": 0,
                              "timeout": 120, "max_retries": 0}
    # langchain-openai >= 0.3 sends max_tokens=12 as max_completion_tokens: ignored, the model ran on to its end
    reply = ChatOpenAI(max_tokens=12, **common).invoke(STORY)
    assert 0 < reply.usage_metadata["output_tokens"] <= 12
    reply = ChatOpenAI(max_completion_tokens=5, **common).invoke(STORY)
    assert 0 < reply.usage_metadata["output_tokens"] <= 5
    # greedy, the model answers "Say hi." in 24 tokens: only ignore_eos takes it to the limit
    forced = ChatOpenAI(max_completion_tokens=LIMIT, extra_body={"ignore_eos": True}, **common).invoke(HI)
    assert forced.usage_metadata["output_tokens"] == LIMIT
    assert forced.response_metadata["finish_reason"] == "length"


def test_litellm_honours_max_tokens(mesh: Mesh) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of litellm's price list
    import litellm

    common: dict[str, Any] = {"model": f"openai/{MODEL}", "api_base": f"{mesh.base_url}/v1", "api_key": "k",
                              "temperature": 0, "timeout": 120}
    reply = litellm.completion(max_tokens=7, messages=[{"role": "user", "content": STORY}], **common)
    assert 0 < reply.usage.completion_tokens <= 7
    forced = litellm.completion(max_tokens=LIMIT, messages=[{"role": "user", "content": HI}],
                                extra_body={"ignore_eos": True}, **common)
    assert forced.usage.completion_tokens == LIMIT and forced.choices[0].finish_reason == "length"


def _chat_content(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}]  # both benchmarks send the prompt as content parts


# The benchmarks sample (no temperature sent); their prompts here are SmolLM2's short-answer ones (the raw one in
# its own chat format), so the limit is usually reached only because of ignore_eos.
RAW = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


BENCHMARK_BODIES = {
    # guidellm, openai backend, a request with a target output length
    "guidellm chat": ("/v1/chat/completions", {
        "model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": LIMIT, "stop": None, "ignore_eos": True,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": _chat_content("Hi")}],
    }),
    "guidellm completions": ("/v1/completions", {
        "model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": LIMIT, "stop": None, "ignore_eos": True, "prompt": RAW,
    }),
    # vllm bench serve --backend openai-chat / --backend openai (vllm)
    "vllm bench chat": ("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": _chat_content("Hi")}],
        "max_completion_tokens": LIMIT, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }),
    "vllm bench completions": ("/v1/completions", {
        "model": MODEL, "prompt": RAW, "repetition_penalty": 1.0, "max_tokens": LIMIT,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }),
}


async def _stream(url: str, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """The status and the decoded `data:` frames of a streamed request, read as the benchmarks read them."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        async with session.post(url, json=body, headers={"Authorization": "Bearer k"}) as r:
            if r.status != 200:
                return r.status, [await r.json()]
            frames = []
            async for line in r.content:
                text = line.decode().strip()
                if text.startswith("data: ") and text != "data: [DONE]":
                    frames.append(json.loads(text.removeprefix("data: ")))
            return r.status, frames


@pytest.mark.parametrize("name", list(BENCHMARK_BODIES))
def test_benchmark_bodies_finish_exactly_at_their_limit(mesh: Mesh, name: str) -> None:
    path, body = BENCHMARK_BODIES[name]
    status, frames = asyncio.run(_stream(mesh.base_url + path, body))
    assert status == 200, frames
    limit = body.get("max_completion_tokens") or body["max_tokens"]
    usage = [f["usage"] for f in frames if f.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == limit  # ignore_eos: never stops early
    finishes = [c["finish_reason"] for f in frames for c in f.get("choices", []) if c.get("finish_reason")]
    assert finishes == ["length"]


def test_fields_not_honoured_are_named_in_the_400(mesh: Mesh) -> None:
    oai = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="k", max_retries=0, timeout=60)
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=hi, max_tokens=3, extra_body={"prompt_logprobs": 1})
    assert err.value.param == "prompt_logprobs" and "prompt_logprobs is not supported" in err.value.message
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\] \(image_url\): image and file"):
        oai.chat.completions.create(model=MODEL, messages=image, max_tokens=3)
    # neutral values and the developer role pass
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": "Answer in one word."}, *hi], max_tokens=3,
        logprobs=False, presence_penalty=0, n=1, temperature=0,
    )
    assert 0 < reply.usage.completion_tokens <= 3


def test_logit_bias_and_penalties_change_the_answer(mesh: Mesh) -> None:
    """Through prefill -> decode: +100 forces a token at every position; with three tokens forced, greedy repeats
    the likeliest one, and presence + frequency penalties (counted over the output, prefill's token included)
    push it out for the others."""
    oai = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="k", max_retries=0, timeout=120)
    hi = [{"role": "user", "content": HI}]
    common: dict[str, Any] = {"model": MODEL, "messages": hi, "extra_body": {"ignore_eos": True}}
    forced = oai.chat.completions.create(max_tokens=4, temperature=1.0, seed=7, logit_bias={"5000": 100}, **common)
    assert forced.choices[0].message.content.split() == ["properly"] * 4  # token 5000 is " properly"
    three = {"5000": 100, "3000": 100, "2000": 100}  # " properly", " Pre", " temper"
    plain = oai.chat.completions.create(max_tokens=12, temperature=0, logit_bias=three, **common)
    words = plain.choices[0].message.content.split()
    assert len(set(words)) == 1 and len(words) == 12
    penalised = oai.chat.completions.create(max_tokens=12, temperature=0, logit_bias=three, presence_penalty=2,
                                            frequency_penalty=2, **common)
    words = penalised.choices[0].message.content.split()
    assert set(words) == {"properly", "Pre", "temper"} and len(words) == 12
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(max_tokens=2, logit_bias={"5000": 101}, **common)
    assert err.value.param == "logit_bias" and "[-100, 100]" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(max_tokens=2, logit_bias={"49152": 1}, **common)  # SmolLM2 has 49152 tokens
    assert err.value.param == "logit_bias" and "out of vocabulary" in err.value.message


async def _overload(base_url: str) -> None:
    import anthropic

    long = {"model": MODEL, "messages": [{"role": "user", "content": STORY}], "max_tokens": 120,
            "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        # MAX_QUEUED streams in flight, each past its first frame: admitted, and running until its limit
        streams = [await session.post(f"{base_url}/v1/chat/completions", json=long) for _ in range(MAX_QUEUED)]
        for r in streams:
            assert r.status == 200
            assert (await r.content.readline()).startswith(b"data: ")
        # the next requests are refused at once, before anything is queued, in each API's own shape
        chat = {**long, "stream": False, "max_tokens": 3}
        for _ in range(4):
            async with session.post(f"{base_url}/v1/chat/completions", json=chat) as r:
                assert r.status == 429
                assert int(r.headers["Retry-After"]) >= 1
                error = (await r.json())["error"]
                assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
        messages = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
        async with session.post(f"{base_url}/v1/messages", json=messages) as r:
            assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["type"] == "rate_limit_error"
        oai = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="k", max_retries=0, timeout=60)
        with pytest.raises(openai.RateLimitError) as err:
            await oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
        assert err.value.response.headers["retry-after"]
        claude = anthropic.AsyncAnthropic(base_url=base_url, api_key="k", max_retries=0, timeout=60)
        with pytest.raises(anthropic.RateLimitError):
            await claude.messages.create(**messages)
        # the admitted streams finish whole
        for r in streams:
            frames = [orjson.loads(line[6:]) async for line in r.content
                      if line.startswith(b"data: {")]
            finishes = [c["finish_reason"] for f in frames for c in f.get("choices", []) if c.get("finish_reason")]
            assert finishes == ["length"]
            r.release()
        # and their places are free again
        reply = await oai.chat.completions.create(model=MODEL, messages=messages["messages"], max_tokens=3)
        assert 0 < reply.usage.completion_tokens <= 3


def test_past_the_queue_bound_clients_get_429_with_retry_after(mesh: Mesh) -> None:
    asyncio.run(_overload(mesh.base_url))
