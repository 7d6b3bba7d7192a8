"""--gpu-memory-utilization on a GPU: the worker's share of the whole device (weights, the measured activation
peak and the KV pool) sizes its KV pool
(marked gpu: skipped without CUDA). Run on an H200 2026-12-01 (as a script, the device copy lacking orjson):
share 0.05 of 139.8 GiB -> KV pool 6.58 GiB, 6.99 GiB reserved; an earlier engine still held counts against
the share, as it should (the share is this process's)."""

from __future__ import annotations

import gc

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.random_model import SHAPES, random_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GiB = 1 << 30


@pytest.mark.parametrize("share", [0.05, 0.1])
def test_the_kv_pool_fills_the_share_less_the_weights(share: float) -> None:
    gc.collect()  # an engine is freed by the collector (its scheduler's callbacks refer back to it)
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info()
    engine = Engine(random_llama(SHAPES["smollm2-135m"], "cuda"), device="cuda",
                    gpu_memory_utilization=share, cuda_graphs=False)
    pool = engine.kv.block_bytes * engine.blocks.num_blocks
    reserved = torch.cuda.memory_reserved()
    print(f"share {share}: total {total / GiB:.1f} GiB, KV pool {pool / GiB:.2f} GiB, reserved {reserved / GiB:.2f}")
    assert reserved <= total * share + 64 * (1 << 20)  # weights + pool within the share (allocator rounding)
    assert pool >= total * share - 2 * GiB  # the weights (0.3 GiB) and the model's buffers take the rest
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def test_a_share_the_weights_already_fill_is_refused() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.0001"):
        Engine(random_llama(SHAPES["smollm2-135m"], "cuda"), device="cuda",
               gpu_memory_utilization=0.0001, cuda_graphs=False)


WORKER = """
import sys, torch
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.random_model import SHAPES, random_llama
from shared.schemas.generate import SamplingParams
engine = Engine(random_llama(SHAPES["smollm2-135m"], "cuda"), device="cuda",
                gpu_memory_utilization=float(sys.argv[1]), max_batch_tokens=2048)
out = run_to_completion(engine, [EngineRequest("r", list(range(5, 1500)), SamplingParams(temperature=0), 8)])
pool = engine.kv.block_bytes * engine.blocks.num_blocks
print("pool", pool, "reserved", torch.cuda.memory_reserved(), "peak", torch.cuda.max_memory_reserved(),
      "tokens", len(out["r"]), flush=True)
sys.stdin.readline()  # hold the memory until the other worker has taken its share too
"""


def test_two_workers_share_one_gpu() -> None:
    """A prefill and a decode worker on one GPU (two processes, as `deepinfer up` starts them, 0.45 each): the
    second sizes its pool while the first holds its own, and both generate; neither process outgrows its share
    (the activation peak was measured before the pool was sized, so a full step stays inside it)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    _, total = torch.cuda.mem_get_info()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    procs, lines = [], []
    try:
        for _ in range(2):
            p = subprocess.Popen([sys.executable, "-c", WORKER, "0.45"], cwd=root, env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            procs.append(p)
            lines.append(p.stdout.readline())  # the first holds its pool while the second starts
        print(lines)
        for line in lines:
            fields = line.split()
            assert fields[0] == "pool", line
            pool, reserved, peak, tokens = (int(v) for v in fields[1::2])
            assert tokens == 8 and pool > 0.3 * total
            assert peak <= 0.45 * total + 256 * (1 << 20)  # (allocator rounding) the profile's and the real steps' peaks included
    finally:
        for p in procs:
            p.communicate("\n", timeout=60)
    assert all(p.returncode == 0 for p in procs)
