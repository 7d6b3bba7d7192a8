"""What the logits processors (repetition penalty, min_tokens) and min_p cost a decode step on a GPU.

    python bench/sampling_processors.py [--batch 64] [--shape smollm2-135m]

Random bf16 weights, 128-token prompts, every row greedy or seeded: Engine.step() wall time per decode step
(overlapped, CUDA graphs where Triton is installed), with no row, every row, and one row using each feature.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.engine.engine import Engine, EngineRequest  # noqa: E402
from shared.engine.random_model import SHAPES, random_llama  # noqa: E402
from shared.schemas.generate import SamplingParams  # noqa: E402

PLAIN = {"temperature": 0.8, "seed": 1, "top_p": 0.9, "ignore_eos": True}
CASES = {
    "none": {},
    "repetition_penalty 1.2": {"repetition_penalty": 1.2},
    "min_tokens 1000": {"min_tokens": 1000, "max_tokens": 1000},
    "min_p 0.05": {"min_p": 0.05},
    "all three": {"repetition_penalty": 1.2, "min_tokens": 1000, "max_tokens": 1000, "min_p": 0.05},
}


def step_ms(engine: Engine, batch: int, extra: dict, everyone: bool, steps: int = 48) -> float:
    r = random.Random(0)
    vocab = engine.config.vocab_size
    for i in range(batch):
        sampling = SamplingParams(**PLAIN, **(extra if everyone or i == 0 else {}))
        engine.add(EngineRequest(f"r{i}", [r.randrange(3, vocab) for _ in range(128)], sampling, steps + 16))
    while engine.scheduler.waiting or any(s.num_remaining > 1 for s in engine.scheduler.running):
        engine.step()  # prefill
    for _ in range(8):
        engine.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for i in range(batch):
        engine.abort(f"r{i}")
    while engine.has_work():
        engine.step()
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--shape", default="smollm2-135m")
    args = p.parse_args()
    model = random_llama(SHAPES[args.shape], "cuda")
    engine = Engine(model, device="cuda", kv_blocks=4096, max_running=args.batch)
    print(f"{torch.cuda.get_device_name()}, {args.shape}, batch {args.batch}, median Engine.step() per decode step")
    print("| feature | no row | every row | one row |\n| --- | --- | --- | --- |")
    step_ms(engine, args.batch, {}, True)  # warm-up: graphs captured
    for name, extra in CASES.items():
        every = step_ms(engine, args.batch, extra, True)
        one = step_ms(engine, args.batch, extra, False)
        base = step_ms(engine, args.batch, {}, True)
        print(f"| {name} | {base:.3f} ms | {every:.3f} ms | {one:.3f} ms |", flush=True)


if __name__ == "__main__":
    main()
