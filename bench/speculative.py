"""Prompt-lookup (n-gram) speculative decoding on SmolLM2: tokens/s and accepted length, with and without drafts.

    python bench/speculative.py [--device cpu] [--batch 1 4] [--tokens 48] [--out results.md]

Real SmolLM2-135M-Instruct weights, greedy, ignore_eos (every configuration generates the same tokens: the bench
checks it). Two workloads: "quoting" (code edits and summaries whose answers copy their context: the assistant
turn is started on the copy) and "free" (plain chat, little to copy). Configurations: no speculation, fixed K in
{1, 2, 4}, and the adaptive policy with K = 4. A batch of b runs b requests together, once per prompt of the
workload (request i of round j takes prompt i + j), so batch 1 too covers every prompt; tok/s is generated tokens over the decode wall time (prefill excluded: it is the same for every run);
tokens/step is generated tokens per decode step and request, which a busy shared CPU does not skew.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.engine.engine import Engine, EngineRequest  # noqa: E402
from shared.engine.loader import LoadedModel, load  # noqa: E402
from shared.models import resolve  # noqa: E402
from shared.schemas.generate import SamplingParams  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(vlaues)
'''
ARTICLE = ("The city council voted on Monday to extend the tram line to the airport. The extension will cost 240 "
           "million euros, open in 2029, and carry an expected 18,000 passengers a day. Opponents argued that the "
           "money should go to bus routes in the northern districts instead.")
EMAIL = ("Hi Sam, the deploy is moved to Thursday at 10:00 because the database migration needs another review. "
         "Please tell the support team and update the status page. Thanks, Alex")


def chat(user: str, start: str = "") -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{start}"


WORKLOADS = {
    "quoting": [
        chat(f"Fix the typo in this function and return the whole corrected function:\n{CODE}",
             "def mean(values):\n    total = 0\n"),
        chat(f"Quote the first two sentences of this article word for word:\n{ARTICLE}",
             "The city council voted on Monday"),
        chat(f"Repeat this email exactly:\n{EMAIL}", "Hi Sam, the deploy is moved"),
    ],
    "free": [
        chat("Write a short story about a dragon who learns to cook."),
        chat("What are three good habits for staying healthy?"),
        chat("Explain why the sky is blue to a ten-year-old."),
    ],
}
CONFIGS = {  # name: (K, method, policy); K 0: no speculation
    "none": (0, "mtp", "fixed"),
    "ngram K=1": (1, "ngram", "fixed"),
    "ngram K=2": (2, "ngram", "fixed"),
    "ngram K=4": (4, "ngram", "fixed"),
    "ngram adaptive K=4": (4, "ngram", "adaptive"),
}


@dataclass
class Run:
    tokens_per_s: float
    tokens_per_step: float
    outputs: dict[str, list[int]]
    drafted: int
    accepted: int
    verifies: int


def run(loaded: LoadedModel, device: str, prompts: list[list[int]], batch: int, tokens: int, config: tuple
        ) -> Run:
    k, method, policy = config
    engine = Engine(loaded, device=device, kv_blocks=64 * batch + 64, max_running=max(batch, 1),
                    max_batch_tokens=max(512, 256 * batch), speculative_tokens=k, speculative_method=method,
                    speculative_policy=policy)
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i in range(batch):
        engine.add(EngineRequest(f"r{i}", prompts[i % len(prompts)], sampling, tokens))
        out[f"r{i}"] = []

    def collect(step: list) -> None:
        for o in step:
            out[o.request_id] += o.token_ids

    while engine.scheduler.waiting or any(s.num_remaining > 1 for s in engine.scheduler.running):
        collect(engine.step())  # prefill (and each request's first token)
    first = sum(map(len, out.values()))
    start, steps = time.perf_counter(), 0
    while engine.has_work():
        step = engine.step()
        if not step:
            break
        steps += 1
        collect(step)
    wall = time.perf_counter() - start
    generated = sum(map(len, out.values())) - first
    return Run(generated / wall, generated / max(steps, 1) / batch, out, engine.spec_drafted, engine.spec_accepted, engine.spec_verifies)


def rounds(runs: list[Run]) -> Run:
    """One workload's rounds as one run: rates averaged over rounds, outputs and counters together."""
    outputs = {f"{j}:{rid}": ids for j, r in enumerate(runs) for rid, ids in r.outputs.items()}
    return Run(sum(r.tokens_per_s for r in runs) / len(runs), sum(r.tokens_per_step for r in runs) / len(runs),
               outputs, sum(r.drafted for r in runs), sum(r.accepted for r in runs), sum(r.verifies for r in runs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = p.parse_args()
    files = resolve(MODEL)
    loaded, tok = load(files), load_tokenizer(files)
    run(loaded, args.device, [tok.encode(chat("Hi"))], 1, 4, CONFIGS["ngram K=2"])  # warm up
    lines = ["| workload | batch | config | tok/s | vs none | tokens/step | acceptance | mean accepted length |",
             "|---|---|---|---|---|---|---|---|"]
    for workload, texts in WORKLOADS.items():
        prompts = [tok.encode(t) for t in texts]
        for batch in args.batch:
            base: Run | None = None
            for name, config in CONFIGS.items():
                r = rounds([run(loaded, args.device, prompts[j:] + prompts[:j], batch, args.tokens, config)
                            for j in range(len(prompts))])
                if base is None:
                    base = r
                elif r.outputs != base.outputs:
                    raise SystemExit(f"{workload} batch {batch} {name}: output differs from plain decoding")
                rate = f"{r.accepted / r.drafted:.2f}" if r.drafted else "-"
                length = f"{1 + r.accepted / r.verifies:.2f}" if r.verifies else "-"
                lines.append(f"| {workload} | {batch} | {name} | {r.tokens_per_s:.1f} | "
                             f"{r.tokens_per_s / base.tokens_per_s:.2f}x | {r.tokens_per_step:.2f} | {rate} | {length} |")
                print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
