"""Expert parallelism over NCCL: the CPU test's cases (tests/ep_ranks.py), one rank a GPU, the Triton kernels on
(the fused MoE computes each rank's slots), against the single-process engine on cuda:0 (marked gpu). One rank
(one GPU: the exchanges are NCCL's with a single peer, the fused kernel on a slot subset) and two (skipped with
fewer than 2 CUDA devices)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import ep_ranks, v4_checkpoints

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v4-ep-gpu")
    v4_checkpoints.build(path, "mixed")
    return path


@pytest.mark.parametrize("world", [1, 2])
def test_expert_parallel_over_nccl_equals_one_gpu(world: int, checkpoint: Path, tmp_path: Path) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    want = ep_ranks.reference(checkpoint, "cuda:0")
    # 1e-4: the GPU's fp32 GEMMs and the fused kernel's summation order differ a little more than the CPU's
    ep_ranks.check(ep_ranks.run(world, checkpoint, tmp_path, "cuda"), want, tol=1e-4)
