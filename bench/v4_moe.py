"""One V4-Flash MoE layer's experts (256 routed of 2048 + 1 shared, hidden 4096, top 6, bf16, random weights):
the fused Triton MoE (eager, and replayed from a CUDA graph) against the torch path of moe.py, by batch size,
with the floor: the weights of the touched experts read once at 4.2 TB/s, or the FLOPs at 989 TFLOP/s.

    python -m bench.v4_moe [--experts 256] [--batches 1,8,32,128,512,2048]
"""

from __future__ import annotations

import argparse

import torch

from shared.engine import cuda_graphs
from shared.engine.kernels.moe import fused_moe
from shared.engine.models.deepseek_v4.moe import experts, shared_expert
from shared.engine.models.deepseek_v4.weights import Experts

D, I, K, LIMIT, BW, FLOPS = 4096, 2048, 6, 10.0, 4.2e12, 989e12  # H200: HBM3e, dense bf16


def _time(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _graphed(fn):
    graph, _ = cuda_graphs.capture(fn, None)  # the engine's own warm-up-then-capture
    return graph.replay


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--batches", default="1,8,32,128,512,2048")
    args = ap.parse_args()
    E, dt = args.experts, torch.bfloat16
    w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=dt) / D**0.5
    w2 = torch.randn(E, D, I, device="cuda", dtype=dt) / I**0.5
    routed = Experts(w13, w2)
    shared = Experts(torch.randn(1, 2 * I, D, device="cuda", dtype=dt) / D**0.5,
                     torch.randn(1, D, I, device="cuda", dtype=dt) / I**0.5)
    expert_bytes = 3 * I * D * 2
    print(f"{torch.cuda.get_device_name()}, {E} experts of {I} + 1 shared, hidden {D}, top {K}, bf16")
    print("| batch | touched | floor ms | fused ms | fused graph ms | % of floor | torch ms | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for T in map(int, args.batches.split(",")):
        x = torch.randn(T, D, device="cuda", dtype=dt)
        w, chosen = torch.rand(T, E, device="cuda").topk(K, dim=-1)
        touched = int(torch.unique(chosen).numel()) + 1
        floor = max(touched * expert_bytes / BW, 2 * T * (K + 1) * 3 * I * D / FLOPS) * 1e3  # bytes or FLOPs

        def ours():
            return fused_moe(x, chosen, w, w13, w2, LIMIT, (shared.w13[0], shared.w2[0]))

        def torch_path():
            return experts(routed, x, chosen, w, LIMIT) + shared_expert(shared, x, LIMIT)

        fused_ms, torch_ms = _time(ours), _time(torch_path)
        graph_ms = _time(_graphed(ours))
        print(f"| {T} | {touched} | {floor:.3f} | {fused_ms:.3f} | {graph_ms:.3f} | {100 * floor / graph_ms:.0f} % "
              f"| {torch_ms:.3f} | {torch_ms / graph_ms:.1f}x |")


if __name__ == "__main__":
    main()
