"""Expert parallelism over NCCL: the CPU test's cases (tests/ep_ranks.py) on 2 GPUs, one rank each, the Triton
kernels on (the fused MoE computes each rank's slots), against the single-process engine on cuda:0 (marked gpu;
skipped with fewer than 2 CUDA devices)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import ep_ranks, v4_checkpoints

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


def test_expert_parallel_over_nccl_equals_one_gpu(tmp_path: Path) -> None:
    checkpoint = tmp_path / "v4"
    v4_checkpoints.build(checkpoint, "mixed")
    want = ep_ranks.reference(checkpoint, "cuda:0")
    (tmp_path / "ranks").mkdir()
    # 1e-4: the GPU's fp32 GEMMs and the fused kernel's summation order differ a little more than the CPU's
    ep_ranks.check(ep_ranks.run(2, checkpoint, tmp_path / "ranks", "cuda"), want, tol=1e-4)
