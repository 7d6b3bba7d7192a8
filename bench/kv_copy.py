"""The engine's share of the KV path on one device: a run of blocks exported into and imported from one host buffer
(export_run / import_run), against the host<->device copy ceilings measured in the same run. Needs only torch and
numpy (no NATS, no store), so it runs on a bare GPU host:

    python3 bench/kv_copy.py [--device cuda] [--llama-tokens 2048] [--v4-tokens 77824]

Buffers: an arena slot (shared memory, pageable), the same arena page-locked (cudaHostRegister), a pinned tensor.
Ceilings: one copy of the run's bytes host -> device and device -> host, pinned and pageable.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.engine.kv_cache import CacheSpec, KVCache, PagedSpec  # noqa: E402
from shared.engine.models.deepseek_v4.cache import V4Cache  # noqa: E402
from shared.kv_arena import Arena, arena_path  # noqa: E402

MiB = 1 << 20


def llama_8b(blocks: int, device: torch.device) -> KVCache:
    """Llama-3-8B's KV: 32 layers x 8 KV heads x 128, bf16, 16-token blocks (2 MiB a block)."""
    spec = CacheSpec(PagedSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype=torch.bfloat16), 0)
    cache = KVCache(spec, blocks, device)
    cache.kv.uniform_()
    return cache


def v4_full(blocks: int, device: torch.device) -> V4Cache:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kv_path import v4_spec  # the same V4-Flash widths at 43 layers as bench/kv_path.py

    cache = V4Cache(v4_spec(), blocks, device, torch.bfloat16)
    for t in cache._paged:  # noqa: SLF001
        t.uniform_()
    return cache


def timed(fn, device: torch.device, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def rate(nbytes: int, s: float) -> str:
    return f"{s * 1e3:,.1f} ms ({nbytes / s / 1e9:,.1f} GB/s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--llama-tokens", type=int, default=2048, help="Llama-8B-shape prompt (0: skip)")
    parser.add_argument("--v4-tokens", type=int, default=77824, help="V4 full-depth prompt (0: skip)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, {os.cpu_count()} cores\n")
    print("| layout | tokens | MB | buffer | export_run | import_run | h2d ceiling | d2h ceiling |")
    print("|---|---|---|---|---|---|---|---|")
    for name, tokens, make, bt in (("llama-8b", args.llama_tokens, llama_8b, 16), ("v4", args.v4_tokens, v4_full, 128)):
        if not tokens:
            continue
        n = tokens // bt
        src, dst = make(n, device), make(n, device)
        blocks = list(range(n))
        nbytes = n * src.block_bytes
        arena = Arena(arena_path(f"kv-copy-{os.getpid()}"), slots=1, slot_bytes=nbytes)
        try:
            offset = arena.take()
            slot = arena.view(offset, nbytes)
            buffers: list[tuple[str, object]] = [("arena (pageable)", slot)]
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
            pageable = torch.empty(nbytes, dtype=torch.uint8)
            dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
            ceilings = {
                "pinned": (timed(lambda: dev.copy_(pinned), device, args.repeat),
                           timed(lambda: pinned.copy_(dev), device, args.repeat)),
                "pageable": (timed(lambda: dev.copy_(pageable), device, args.repeat),
                             timed(lambda: pageable.copy_(dev), device, args.repeat)),
            }
            registered = False
            if cuda:
                mapped = np.frombuffer(slot, dtype=np.uint8)
                registered = torch.cuda.cudart().cudaHostRegister(mapped.ctypes.data, nbytes, 0) == 0
            if registered:
                buffers.append(("arena (registered)", slot))
            buffers.append(("pinned tensor", pinned))
            for label, buf in buffers:
                out = timed(lambda: src.export_run(blocks, buf), device, args.repeat)
                if label.startswith("arena"):  # what decode gets from get_run: views of the slot, imported in place
                    views = arena.lend(offset, [src.block_bytes] * n)
                    inn = timed(lambda: dst.write_blocks(blocks, views), device, args.repeat)
                    del views  # the slot comes back: take it again for the next buffer
                    offset = arena.take()
                else:
                    inn = timed(lambda: dst.import_run(blocks, buf), device, args.repeat)
                kind = "pinned" if label != "arena (pageable)" else "pageable"
                h2d, d2h = ceilings[kind]
                print(f"| {name} | {tokens} | {nbytes / 1e6:,.0f} | {label} | {rate(nbytes, out)} | {rate(nbytes, inn)} "
                      f"| {rate(nbytes, h2d)} {kind} | {rate(nbytes, d2h)} {kind} |", flush=True)
            if registered:
                torch.cuda.cudart().cudaHostUnregister(np.frombuffer(slot, dtype=np.uint8).ctypes.data)
            del slot
        finally:
            arena.close()


if __name__ == "__main__":
    main()
