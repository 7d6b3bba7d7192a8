"""What the deterministic mode promises, as checks on an engine (CPU interpreter tests and the GPU tests):

    alone vs batched     a request alone, and the same request with 7 others (other lengths, prefilled and
                         decoded in the same steps), give the same tokens and bitwise the same logits
    migrated             prefill -> decode of N tokens, and a continuation from prompt + the first k tokens
                         (output_offset k, a fresh engine: another worker) give the same tokens k.. and logits

Logits are taken where the engine samples them (LogitTap wraps the runner): one row per (request, output
position), copied to the host, before any processor or grammar touches them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.schemas.generate import SamplingParams

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)


class LogitTap:
    """Records the logits of every sampled row of every step: (request id, output position) -> (V,) float32."""

    def __init__(self, engine: Engine) -> None:
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        runner = engine.runner
        inner = runner.run

        def run(plan):
            logits = inner(plan)  # (N, V) in chunk order
            i = 0
            for c in plan.chunks:
                if not c.sample:
                    continue
                for r in range(c.num_tokens if c.drafts else 1):
                    self.rows[c.seq.request_id, c.seq.output_position + r] = logits[i].detach().cpu().clone()
                    i += 1
            return logits

        runner.run = run

    def of(self, request_id: str, positions: range) -> list[torch.Tensor]:
        return [self.rows[request_id, p] for p in positions]


@dataclass
class Outcome:
    tokens: list[int]
    logits: list[torch.Tensor]  # one per token, at its output position


def generate(engine: Engine, requests: list[EngineRequest]) -> dict[str, Outcome]:
    tap = LogitTap(engine)
    tokens = run_to_completion(engine, requests)
    return {r.request_id: Outcome(tokens[r.request_id], tap.of(r.request_id, range(r.output_offset, r.output_offset +
                                                                                  len(tokens[r.request_id]))))
            for r in requests}


def prompts(n: int, vocab: int, seed: int, lo: int = 5, hi: int = 90) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(3, vocab) for _ in range(r.randrange(lo, hi))] for _ in range(n)]


def same(a: Outcome, b: Outcome) -> tuple[bool, bool, float]:
    """(tokens equal, logits bitwise equal, largest logit difference) over the positions both have."""
    n = min(len(a.logits), len(b.logits))
    diffs = [float((x - y).abs().max()) for x, y in zip(a.logits[:n], b.logits[:n])]
    bitwise = len(a.logits) == len(b.logits) and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    return a.tokens == b.tokens, bitwise, max(diffs, default=0.0)


def alone_vs_batched(make: Callable[[], Engine], prompt: list[int], others: list[list[int]], n: int,
                     sampling: SamplingParams) -> tuple[bool, bool, float]:
    """The request alone on one engine, then with `others` on a fresh one (all added at once: one batch)."""
    alone = generate(make(), [EngineRequest("a", prompt, sampling, n)])["a"]
    crowd = [EngineRequest(f"o{i}", p, SamplingParams(temperature=0.7, seed=i, ignore_eos=True), n + i % 3)
             for i, p in enumerate(others)]
    mixed = crowd[: len(crowd) // 2] + [EngineRequest("a", prompt, sampling, n)] + crowd[len(crowd) // 2 :]
    batched = generate(make(), mixed)["a"]
    return same(alone, batched)


def migrated(make: Callable[[], Engine], prompt: list[int], others: list[list[int]], n: int, k: int,
             sampling: SamplingParams) -> tuple[bool, bool, float]:
    """Prefill then n decode steps, vs a continuation on another engine from prompt + the first k tokens (with
    `others` around it there, as a migrated request lands in a worker's running batch)."""
    first = generate(make(), [EngineRequest("a", prompt, sampling, n)])["a"]
    cont = EngineRequest("a", prompt + first.tokens[:k], sampling, n - k, output_offset=k)
    crowd = [EngineRequest(f"o{i}", p, GREEDY, n) for i, p in enumerate(others)]
    second = generate(make(), crowd + [cont])["a"]
    return same(Outcome(first.tokens[k:], first.logits[k:]), second)
