"""What the mesh costs: TTFT and decode speed through every service versus the same engine in-process.

Runs, in one process and one run: (a) the engine driven in-process (`AsyncEngine`, no NATS), (b) the whole mesh
started by `deepinfer up` on a free port, called over HTTP with streaming chat completions. Both see the same
rendered prompt (the recipe's chat template), greedy sampling and the same max_tokens, for 1 and for 8
concurrent streams. Prints a table; ratios matter, not absolute times (shared, noisy machines).

    .venv/bin/python bench/mesh_overhead.py [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.recipe.chat_template import ChatTemplate  # noqa: E402
from shared.engine.async_engine import AsyncEngine  # noqa: E402
from shared.engine.engine import Engine, EngineRequest  # noqa: E402
from shared.model_info import load_model_info  # noqa: E402
from shared.models import resolve  # noqa: E402
from shared.schemas.generate import SamplingParams  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402
from tests.integration.mesh import start_mesh  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [f"Write a long story about a lighthouse keeper named Ada, chapter {i}." for i in range(8)]


@dataclass
class Stream:
    ttft: float  # seconds from send to first token
    tokens: int
    decode_s: float  # first token -> last token

    @property
    def decode_tps(self) -> float:
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else 0.0


@dataclass
class Row:
    path: str
    streams: int
    ttft_ms: float
    decode_tps: float  # per stream, median
    total_tps: float  # all streams' tokens / wall time


def summarize(path: str, streams: list[Stream], wall: float) -> Row:
    return Row(
        path,
        len(streams),
        statistics.median(s.ttft for s in streams) * 1000,
        statistics.median(s.decode_tps for s in streams),
        sum(s.tokens for s in streams) / wall,
    )


async def in_process(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int) -> Row:
    async def one(i: int, ids: list[int]) -> Stream:
        sent = time.perf_counter()
        first = last = 0.0
        n = 0
        req = EngineRequest(
            request_id=f"bench-{i}-{sent}",
            token_ids=ids,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            max_new_tokens=max_tokens,
        )
        async for out in engine.generate(req):
            if out.token_ids:
                last = time.perf_counter()
                first = first or last
                n += len(out.token_ids)
        return Stream(first - sent, n, last - first)

    start = time.perf_counter()
    streams = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return summarize("in-process engine", list(streams), time.perf_counter() - start)


async def through_mesh(base_url: str, prompts: list[str], max_tokens: int) -> Row:
    async def one(session: aiohttp.ClientSession, text: str) -> Stream:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = time.perf_counter()
        first = last = 0.0
        tokens = 0
        async with session.post(f"{base_url}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
        return Stream(first - sent, tokens, last - first)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        streams = await asyncio.gather(*(one(session, p) for p in prompts))
    return summarize("mesh (HTTP -> 6 services)", list(streams), time.perf_counter() - start)


def render(prompts: list[str]) -> list[list[int]]:
    files = resolve(MODEL)
    info = load_model_info(files)
    tokenizer = load_tokenizer(files)
    template = ChatTemplate(info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token)
    return [tokenizer.encode(template.render([{"role": "user", "content": p}])) for p in prompts]


async def run(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    ids = render(PROMPTS)
    engine = AsyncEngine(Engine(MODEL))
    engine.start()
    for n in (1, 8):
        await in_process(engine, ids[:n], args.max_tokens)  # warm-up
        best = [await in_process(engine, ids[:n], args.max_tokens) for _ in range(args.rounds)]
        rows.append(min(best, key=lambda r: r.ttft_ms))
    await engine.stop()
    with tempfile.TemporaryDirectory() as state:
        mesh = start_mesh(Path(state))
        try:
            for n in (1, 8):
                await through_mesh(mesh.base_url, PROMPTS[:n], args.max_tokens)  # warm-up
                best = [await through_mesh(mesh.base_url, PROMPTS[:n], args.max_tokens) for _ in range(args.rounds)]
                rows.append(min(best, key=lambda r: r.ttft_ms))
        finally:
            mesh.stop()
    return rows


def table(rows: list[Row]) -> str:
    base = {r.streams: r for r in rows if r.path.startswith("in-process")}
    out = [
        "| path | streams | TTFT median (ms) | decode tok/s per stream | total tok/s | TTFT ratio | total tok/s ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base[r.streams]
        out.append(
            f"| {r.path} | {r.streams} | {r.ttft_ms:.0f} | {r.decode_tps:.1f} | {r.total_tps:.1f} | "
            f"{r.ttft_ms / b.ttft_ms:.2f}x | {r.total_tps / b.total_tps:.2f}x |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows = asyncio.run(run(args))
    print(f"# mesh overhead, {time.strftime('%Y-%m-%d')}, {platform.machine()} {platform.processor() or ''}, "
          f"{__import__('os').cpu_count()} cores, model {MODEL}, max_tokens {args.max_tokens}, greedy")
    print(table(rows))


if __name__ == "__main__":
    main()
