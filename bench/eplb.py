"""Expert placement on skewed, drifting expert loads (a CPU simulation): max/mean per-GPU load with the initial
placement and with periodic re-planning, and the bytes each re-plan moves.

    python bench/eplb.py [--gpus 8 16 32 64] [--policies hierarchical global best] [--steps 24] [--every 4]
                         [--zipf 1.0] [--drift 0.15] [--min-gain 0.02] [--replay] [--out FILE]

V4-Flash's shape: 43 MoE layers, 256 routed experts, 6 per token, one FP4 expert (3 x 4096 x 2048 weights at 4 bits
plus one 8-bit scale per 32) = 13.4 MB. A group of G GPUs is G / 8 nodes of 8 with G redundant slots (one per
GPU, as DeepSeek's decode layout: 256 + G slots). Each layer's expert popularity is Zipf-like over a random order
of its experts and drifts every window (log-popularity takes a Gaussian step of `--drift`, so hot experts cool and
others heat up); a window routes `--tokens` tokens, drawn multinomially. Every `--every` windows the planner
re-plans from the last `--window` windows (the sliding window) against the placement it runs; each window is
scored on the placement in force during it, so re-planning is measured on loads it has not seen yet.

    max/mean  per layer: the busiest GPU's token-expert pairs over the mean GPU's; averaged over layers and
              windows (the first `--every` windows, before the first plan, are left out of both columns)
    worst     the largest per-layer max/mean over the same windows
    moved     expert weights loaded by GPUs: the first re-plan (from the initial placement, expert e in slot e)
              and the later ones (mean: what following the drift costs), also as a share of every expert's weights

--replay adds rows from real routing counts: a tiny random DeepSeek-V4 (tests/v4_checkpoints, needs transformers)
generates on the CPU and its engine's per-expert counts are planned for 2 and 4 GPUs. Its router is random, so
its loads are mildly skewed: the rows check the path from the engine's counts, not V4-Flash's real skew.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.balancer.experts.moves import replan  # noqa: E402
from services.balancer.experts.plan import Cluster, imbalance, initial, rank_loads  # noqa: E402

LAYERS, EXPERTS, TOP_K = 43, 256, 6
EXPERT_BYTES = 3 * 4096 * 2048 // 2 + 3 * 4096 * 2048 // 32  # FP4 weights + their 8-bit scales: 13,369,344


@dataclass(frozen=True)
class Row:
    source: str
    gpus: int
    policy: str
    static: float
    replanned: float
    static_worst: float
    replanned_worst: float
    replans: int
    moved_first: int  # bytes, the first re-plan (from the initial placement)
    moved_later: float  # bytes, mean of the later ones (following the drift)
    all_bytes: int  # every expert of every layer once
    plan_s: float

    def line(self) -> str:
        return (f"| {self.source} | {self.gpus} | {self.policy} | {self.static:.3f} | {self.replanned:.3f} | "
                f"{self.static_worst:.2f} | {self.replanned_worst:.2f} | {self.replans} | {size(self.moved_first)} | "
                f"{size(self.moved_later)} | {self.moved_later / self.all_bytes:.1%} | {self.plan_s:.2f} |")


def size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def drifting_loads(steps: int, tokens: int, zipf: float, drift: float, seed: int) -> np.ndarray:
    """(steps, layers, experts) token-expert pairs per window."""
    rng = np.random.default_rng(seed)
    ranks = np.stack([rng.permutation(EXPERTS) for _ in range(LAYERS)])  # (L, E): each expert's popularity rank
    logp = -zipf * np.log1p(ranks.astype(float))
    out = np.empty((steps, LAYERS, EXPERTS), dtype=np.int64)
    for t in range(steps):
        p = np.exp(logp - logp.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[t] = np.stack([rng.multinomial(tokens * TOP_K, p[layer]) for layer in range(LAYERS)])
        logp += drift * rng.standard_normal(logp.shape)
    return out


def layer_imbalances(placement: list[list[list[int]]], window: np.ndarray) -> list[float]:
    return [imbalance(rank_loads(ranks, row.tolist())) for ranks, row in zip(placement, window)]


def simulate(source: str, loads: np.ndarray, cluster: Cluster, every: int, window: int, min_gain: float,
             expert_bytes: int) -> Row:
    steps, layers, experts = loads.shape
    static = [initial(experts, cluster)] * layers
    running = static
    scored_static: list[float] = []
    scored_replanned: list[float] = []
    moved: list[int] = []
    plan_s = 0.0
    for t in range(steps):
        if t and t % every == 0:
            seen = loads[max(0, t - window) : t].sum(axis=0)
            started = time.perf_counter()
            result = replan(seen.tolist(), cluster, running, expert_bytes, min_gain)
            plan_s += time.perf_counter() - started
            running = result.placement
            moved.append(result.moved_bytes)
        if t >= every:
            scored_static += layer_imbalances(static, loads[t])
            scored_replanned += layer_imbalances(running, loads[t])
    return Row(source, cluster.ranks, cluster.policy, float(np.mean(scored_static)), float(np.mean(scored_replanned)),
               max(scored_static), max(scored_replanned), len(moved), moved[0], float(np.mean(moved[1:] or [0])),
               layers * experts * expert_bytes, plan_s / len(moved))


def cluster_for(gpus: int, policy: str, experts: int = EXPERTS) -> Cluster:
    per_node = min(gpus, 8)
    return Cluster(nodes=gpus // per_node, ranks_per_node=per_node, slots=experts + gpus, policy=policy)


def replay_loads(steps: int) -> tuple[np.ndarray, int]:
    """(steps, layers, experts) windows of a tiny random V4's own routing counts, and its expert bytes."""
    import tempfile

    import torch

    from shared.engine.engine import Engine, EngineRequest, run_to_completion
    from shared.schemas.generate import SamplingParams
    from tests import v4_checkpoints

    with tempfile.TemporaryDirectory() as tmp:
        v4_checkpoints.build(Path(tmp), "mixed")
        engine = Engine(tmp, kv_blocks=256, max_batch_tokens=64)
        windows, seen = [], engine.expert_counts()
        assert seen is not None
        g = torch.Generator().manual_seed(0)
        for t in range(steps):
            requests = [EngineRequest(f"{t}-{i}", torch.randint(0, 512, (24,), generator=g).tolist(),
                                      SamplingParams(temperature=0.8, seed=i, max_tokens=8), max_new_tokens=8)
                        for i in range(4)]
            run_to_completion(engine, requests)
            counts = engine.expert_counts()
            assert counts is not None
            windows.append((counts - seen).numpy())
            seen = counts
        return np.stack(windows), engine.expert_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--policies", nargs="+", default=["hierarchical", "global", "best"])
    parser.add_argument("--steps", type=int, default=24, help="windows simulated")
    parser.add_argument("--every", type=int, default=4, help="windows between two re-plans")
    parser.add_argument("--window", type=int, default=4, help="windows a plan is made from (sliding)")
    parser.add_argument("--tokens", type=int, default=20000, help="tokens routed per window")
    parser.add_argument("--zipf", type=float, default=1.0, help="popularity exponent (0: uniform)")
    parser.add_argument("--drift", type=float, default=0.15, help="log-popularity step per window")
    parser.add_argument("--min-gain", type=float, default=0.02, help="a layer keeps its placement below this gain")
    parser.add_argument("--replay", action="store_true", help="add rows from a tiny random V4's own counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    lines = ["| loads | GPUs | policy | max/mean static | max/mean re-planned | worst static | worst re-planned | "
             "re-plans | moved, first re-plan | moved, later (mean) | later, of all experts | s / plan |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    loads = drifting_loads(args.steps, args.tokens, args.zipf, args.drift, args.seed)
    source = f"zipf {args.zipf}, drift {args.drift}"
    for gpus in args.gpus:
        for policy in args.policies:
            row = simulate(source, loads, cluster_for(gpus, policy), args.every, args.window, args.min_gain,
                           EXPERT_BYTES)
            lines.append(row.line())
            print(lines[-1], flush=True)
    if args.replay:
        real, expert_bytes = replay_loads(args.steps)
        for gpus in (2, 4):
            cluster = Cluster(nodes=1, ranks_per_node=gpus, slots=real.shape[2] + gpus, policy="best")
            row = simulate("tiny V4 replay", real, cluster, args.every, args.window, args.min_gain, expert_bytes)
            lines.append(row.line())
            print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
