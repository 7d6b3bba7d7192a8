"""Time the V4 decode attention kernel (shared/engine/kernels/v4_decode.py) at V4-Flash shape on a GPU, against
the bytes it must read (bf16 q, the window ring and the compressed keys, the fp32 partials) at the copy rate.

    python bench/v4_decode_kernel.py [--batches 1,8,32,128] [--contexts 4096,65536] [--kv-cache-dtype fp8] [--sweep]

--kv-cache-dtype fp8 stores the ring and the entries as the cache's packed FP8 rows (604 bytes a key, not 1024).

Times are GPU times of a CUDA graph replay (the launch cost on the host is what graphs remove); --sweep tries tile
shapes on CSA at 4K contexts.
"""

from __future__ import annotations

import argparse

import torch
import triton

from shared.engine.kernels.v4_decode import decode_attention
from shared.engine.kv_quant import Fp8Rows, RowLayout
from tests.gpu.test_v4_decode_gpu import BT, D, H, ROPE, TOPK, W, _case, packed

BW = 4.2e12  # bytes/s: the H200's measured copy rate (bench/results/v4_layer_notes.md)


def time_us(fn) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3


def sweep() -> None:
    print("| batch | block_h | block_n | warps | us |")
    print("|---|---|---|---|---|")
    for S in (1, 32, 128):
        q, swa, entries, table, slots, pos, begins, ids, sinks, ratio = _case("csa", [4096] * S, torch.bfloat16)
        for bh in (16, 32, 64):
            for bn in (32, 64):
                for warps in (4, 8):
                    def run() -> torch.Tensor:
                        return decode_attention(q, swa, entries, table, slots, pos, begins, ids, sinks, D**-0.5, W,
                                                ratio, BT, 4096 // ratio, block_h=bh, block_n=bn, num_warps=warps)
                    try:
                        print(f"| {S} | {bh} | {bn} | {warps} | {time_us(run):.1f} |", flush=True)
                    except Exception as exc:  # out of shared memory / registers: say so, go on
                        print(f"| {S} | {bh} | {bn} | {warps} | {type(exc).__name__} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="4096,65536")
    ap.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    if args.sweep:
        sweep()
        return
    fp8 = args.kv_cache_dtype == "fp8"
    print(f"| kind | batch | context | us | bytes MB | floor us | % of floor | {torch.cuda.get_device_name()}, "
          f"{args.kv_cache_dtype} KV |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in ("sliding", "hca", "csa"):
        for ctx in (int(c) for c in args.contexts.split(",")):
            for S in (int(b) for b in args.batches.split(",")):
                q, swa, entries, table, slots, pos, begins, ids, sinks, ratio = _case(kind, [ctx] * S, torch.bfloat16)
                begins.zero_()
                ring: torch.Tensor | Fp8Rows = packed(swa, torch.bfloat16) if fp8 else swa
                ent = packed(entries, torch.bfloat16) if fp8 and entries is not None else entries
                key_bytes = RowLayout(D, ROPE).row_bytes if fp8 else D * 2
                comp = {"sliding": 0, "hca": ctx // 128, "csa": TOPK}[kind]
                keys = min(W, ctx) + comp
                bytes_ = S * (H * D * 2 * 2 + keys * key_bytes)  # q in, out back, keys once per sequence

                def run() -> torch.Tensor:
                    return decode_attention(q, ring, ent, table, slots, pos, begins, ids, sinks, D**-0.5, W,
                                            ratio, BT, ctx // ratio if ratio else 0)

                us = time_us(run)
                floor = bytes_ / BW * 1e6
                print(f"| {kind} | {S} | {ctx} | {us:.1f} | {bytes_ / 1e6:.2f} | {floor:.2f} "
                      f"| {100 * floor / us:.0f} |")


if __name__ == "__main__":
    main()
