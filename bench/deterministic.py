"""What the deterministic mode (--deterministic) costs: tok/s with and without it on one GPU, and whether it holds.

    python bench/deterministic.py [--shapes smollm2-135m,llama3-8b] [--batches 1 8 32] [--prefill 2048]
        [--out bench/results/<date>-deterministic-h200.md]

Random bf16 weights of each shape, one engine per mode (CUDA graphs, overlapped steps, as a worker runs it).
Decode: `batch` sequences of 128-token prompts, tok/s over 32 steps through Engine.step(). Prefill: one
n-token prompt in one step, tokens/s (median of 4 after 2 warm-ups). The last column checks the promise: a
request's 16 greedy tokens' logits alone and in a batch of 8 (other lengths), bitwise.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.engine.engine import Engine, EngineRequest  # noqa: E402
from shared.engine.loader import LoadedModel  # noqa: E402
from shared.engine.random_model import SHAPES, random_llama  # noqa: E402
from shared.schemas.generate import SamplingParams  # noqa: E402
from tests import determinism as det  # noqa: E402

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
PROMPT, STEPS, WARM = 128, 32, 4


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def decode_tps(engine: Engine, batch: int, vocab: int, seed: int) -> float:
    for i, p in enumerate(prompts(batch, PROMPT, vocab, seed)):
        engine.add(EngineRequest(f"d{seed}-{i}", p, GREEDY, WARM + STEPS + 8))
    while engine.scheduler.waiting or any(s.num_computed < PROMPT for s in engine.scheduler.running):
        engine.step()
    for _ in range(WARM):
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    tps = batch * STEPS / (time.perf_counter() - t)
    for rid in list(engine.scheduler.seqs):
        engine.abort(rid)
    while engine.step():
        pass
    return tps


def prefill_tps(engine: Engine, n: int, vocab: int) -> float:
    times = []
    for rep in range(6):
        engine.add(EngineRequest(f"p{rep}", prompts(1, n, vocab, 100 + rep)[0], GREEDY, 1))
        torch.cuda.synchronize()
        t = time.perf_counter()
        while engine.step():
            pass
        times.append(time.perf_counter() - t)
    return n / statistics.median(times[2:])


def holds(model: LoadedModel, deterministic: bool, max_running: int) -> str:
    make = lambda: Engine(model, device="cuda", kv_blocks=1024, max_running=max_running,  # noqa: E731
                          deterministic=deterministic)
    prompt, *others = det.prompts(8, model.config.vocab_size, seed=9, lo=20, hi=300)
    tokens, bitwise, diff = det.alone_vs_batched(make, prompt, others, 16, GREEDY)
    free()
    return "bitwise" if bitwise else f"differs ({diff:.2g}){'' if tokens else ', tokens too'}"


def free() -> None:
    """Engines hold reference cycles (the logit tap's wrapper): collect them before the next one is built."""
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="smollm2-135m,llama3-8b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    header = (["shape", "mode"] + [f"decode b{b} tok/s" for b in args.batches]
              + [f"prefill {args.prefill} tok/s", "alone vs batch of 8"])
    rows = []
    for shape in args.shapes.split(","):
        model = random_llama(SHAPES[shape], "cuda", seed=1, name=shape)
        vocab = model.config.vocab_size
        base: list[float] = []
        for deterministic in (False, True):
            engine = Engine(model, device="cuda", kv_blocks=4096, max_running=max(args.batches),
                            max_batch_tokens=max(args.prefill, 2048), deterministic=deterministic)
            figures = [decode_tps(engine, b, vocab, seed=b) for b in args.batches]
            figures.append(prefill_tps(engine, args.prefill, vocab))
            del engine
            free()
            cells = [f"{f:,.0f}" for f in figures]
            if deterministic:
                cells = [f"{f:,.0f} ({f / b:.0%})" for f, b in zip(figures, base)]
            else:
                base = figures
            rows.append([shape, "deterministic" if deterministic else "default"] + cells
                        + [holds(model, deterministic, 8)])
            print(" | ".join(rows[-1]), flush=True)
        del model
        free()
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
    text = (f"# Deterministic mode: cost on {torch.cuda.get_device_name()} ({datetime.date.today()})\n\n"
            f"torch {torch.__version__}; `python bench/deterministic.py {' '.join(sys.argv[1:])}`. Deterministic "
            "figures in brackets: share of the default's.\n\n" + "\n".join(table) + "\n")
    print("\n" + text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
