"""Constrained decoding's cost: decode tok/s with and without a JSON schema, same engine, same batch, same run.

    python bench/structured.py [--device cpu] [--batch 1 4] [--tokens 48] [--out results.md]
    python bench/structured.py --device cuda --batch 1 32 256 --tokens 128       (the issue's row, on a GPU)

Real SmolLM2-135M-Instruct weights, seeded sampling (temperature 0.8). Every request of a batch asks for a list of
people as JSON; with the schema (an array of nested person objects, `minItems` past what `--tokens` can reach, so
every request decodes exactly --tokens tokens, as the unconstrained ones do with ignore_eos) the output is masked
at every step. tok/s is generated tokens over the decode wall time (prefill excluded); "mask ms/step" is the
host time spent filling and applying the bitmasks per decode step; overhead = 1 - constrained / plain tok/s. On a
GPU a constrained step is not overlapped with the next one (shared/engine/engine.py): that cost is in the row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.engine.engine import Engine, EngineRequest  # noqa: E402
from shared.engine.grammar import Grammars  # noqa: E402
from shared.engine.loader import LoadedModel, load  # noqa: E402
from shared.models import resolve  # noqa: E402
from shared.schemas.generate import Constraint, SamplingParams  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}},
    "required": ["name", "age", "address"]}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 1000}},
          "required": ["people"]}
PROMPTS = ["List some people as JSON: name, age, email, tags and address.",
           "Give me a JSON list of customers with their ages and cities.",
           "Write JSON describing the members of a book club."]


def chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Run:
    tokens_per_s: float
    mask_ms_per_step: float
    generated: int


class _Timed:
    """Grammars.apply with its host time summed (the bitmask fill and the apply launch)."""

    def __init__(self, grammars: Grammars) -> None:
        self.inner, self.seconds = grammars.apply, 0.0

    def __call__(self, *args: object) -> object:
        start = time.perf_counter()
        try:
            return self.inner(*args)
        finally:
            self.seconds += time.perf_counter() - start


def run(loaded: LoadedModel, device: str, prompts: list[list[int]], batch: int, tokens: int,
        constrained: bool) -> Run:
    engine = Engine(loaded, device=device, kv_blocks=None if device == "cuda" else 8 * batch + 64,
                    max_running=max(batch, 1), max_batch_tokens=max(512, 64 * batch))
    timed = _Timed(engine.grammars)
    engine.grammars.apply = timed  # type: ignore[method-assign]
    constraint = Constraint("json_schema", json.dumps(SCHEMA)) if constrained else None
    out: dict[str, int] = {}
    for i in range(batch):
        sampling = SamplingParams(temperature=0.8, seed=i, max_tokens=tokens, ignore_eos=True, constraint=constraint)
        engine.add(EngineRequest(f"r{i}", prompts[i % len(prompts)], sampling, tokens))
        out[f"r{i}"] = 0
    while engine.scheduler.waiting or any(s.num_remaining > 1 for s in engine.scheduler.running):
        for o in engine.step():  # prefill (and each request's first token)
            out[o.request_id] += len(o.token_ids)
    first, timed.seconds = sum(out.values()), 0.0
    start, steps = time.perf_counter(), 0
    while engine.has_work():
        step = engine.step()
        if not step:
            break
        steps += 1
        for o in step:
            out[o.request_id] += len(o.token_ids)
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    generated = sum(out.values()) - first
    assert all(n == tokens for n in out.values()), "every request decodes exactly --tokens tokens"
    return Run(generated / wall, 1000 * timed.seconds / max(steps, 1), generated)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = p.parse_args()
    files = resolve(MODEL)
    loaded, tok = load(files), load_tokenizer(files)
    prompts = [tok.encode(chat(t)) for t in PROMPTS]
    run(loaded, args.device, prompts, 1, 4, True)  # warm up (and compile the schema once)
    lines = ["| batch | plain tok/s | schema tok/s | overhead | mask ms/step |", "|---|---|---|---|---|"]
    for batch in args.batch:
        plain = run(loaded, args.device, prompts, batch, args.tokens, False)
        schema = run(loaded, args.device, prompts, batch, args.tokens, True)
        overhead = 1 - schema.tokens_per_s / plain.tokens_per_s
        lines.append(f"| {batch} | {plain.tokens_per_s:.1f} | {schema.tokens_per_s:.1f} | {100 * overhead:.1f} % | "
                     f"{schema.mask_ms_per_step:.2f} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(f"\n{args.device}, {args.tokens} tokens per request, SmolLM2-135M-Instruct\n{table}")
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
