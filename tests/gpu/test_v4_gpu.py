"""DeepSeek-V4 in the engine on a GPU (marked gpu: skipped without CUDA): the same tokens as on the CPU in fp32,
bf16 runs, MTP speculative decoding changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.schemas.generate import SamplingParams
from tests import v4_checkpoints

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return v4_checkpoints.build_hub(tmp_path_factory.mktemp("v4"))


def _requests() -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(i)).tolist(),
                          GREEDY, max_new_tokens=16, stop_token_ids=[]) for i, n in enumerate((5, 40, 23))]


def test_cuda_fp32_equals_cpu(hub: Path) -> None:
    cpu = run_to_completion(Engine(str(hub), kv_blocks=64), _requests())
    cuda = run_to_completion(Engine(str(hub), device="cuda", dtype=torch.float32, kv_blocks=64), _requests())
    assert cuda == cpu


def test_cuda_graphs_change_nothing(hub: Path) -> None:
    """Decode steps replayed from CUDA graphs (graphs.py) give the eager steps' tokens in fp32, and were used."""
    eager = run_to_completion(Engine(str(hub), device="cuda", dtype=torch.float32, kv_blocks=64, cuda_graphs=False),
                              _requests())
    engine = Engine(str(hub), device="cuda", dtype=torch.float32, kv_blocks=64)
    assert run_to_completion(engine, _requests()) == eager
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs  # captured: (batch, context) buckets
    bf16 = run_to_completion(Engine(str(hub), device="cuda", kv_blocks=64), _requests())
    assert all(len(t) == 16 for t in bf16.values())


def test_warmed_up_graphs_are_every_bucket_and_change_nothing(hub: Path) -> None:
    """Engine.warm_up (a decode worker at start-up) captures every (batch, context) bucket before any request,
    writes nothing a request reads (its capture runs on padding rows), and serving afterwards captures none."""
    eager = run_to_completion(Engine(str(hub), device="cuda", dtype=torch.float32, kv_blocks=64, cuda_graphs=False),
                              _requests())
    engine = Engine(str(hub), device="cuda", dtype=torch.float32, kv_blocks=64, max_running=4)
    graphs = engine.runner.graphs
    assert graphs is not None
    buckets = len(graphs.sizes) * len(graphs.contexts)
    assert engine.warm_up() == buckets == len(graphs.graphs) and engine.warm_up() == 0
    assert run_to_completion(engine, _requests()) == eager
    assert len(graphs.graphs) == buckets


def test_cuda_graphs_count_experts_as_eager_steps_do(hub: Path) -> None:
    """The per-expert routing counts (expert placement's input) from decode steps replayed from CUDA graphs equal
    the eager steps' (the graphs' padding rows, and their warm-up and capture, are not counted)."""
    eager = Engine(str(hub), device="cuda", dtype=torch.float32, kv_blocks=64, cuda_graphs=False)
    graphs = Engine(str(hub), device="cuda", dtype=torch.float32, kv_blocks=64)
    assert run_to_completion(graphs, _requests()) == run_to_completion(eager, _requests())
    assert graphs.runner.graphs is not None and graphs.runner.graphs.graphs
    counts = graphs.expert_counts()
    assert counts is not None and int(counts.sum()) > 0
    assert torch.equal(counts, eager.expert_counts())


def test_cuda_drafts_change_nothing(hub: Path) -> None:
    """fp32: exact. (In bf16 a k + 1-row verify runs other GEMM shapes than a 1-row decode step, so near-ties
    may round apart: bf16 is only checked to run.)"""
    plain = run_to_completion(Engine(str(hub), device="cuda", dtype=torch.float32, kv_blocks=64), _requests())
    spec = Engine(str(hub), device="cuda", dtype=torch.float32, kv_blocks=64, speculative_tokens=2)
    assert run_to_completion(spec, _requests()) == plain
    assert spec.spec_drafted > 0
    bf16 = run_to_completion(Engine(str(hub), device="cuda", kv_blocks=64, speculative_tokens=2), _requests())
    assert all(len(t) == 16 for t in bf16.values())


def test_cuda_speculation_overlaps_and_replays_graphs(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32, the adaptive policy under a load cut-off of 3 sequences: full-batch steps are draft-free, so they
    overlap and replay V4's decode graphs (whose streams the MTP layer advances on), smaller ones draft; the
    tokens are the eager, speculation-free engine's."""
    from shared.engine import verify_policy

    monkeypatch.setattr(verify_policy, "LOAD_FULL", 1)
    monkeypatch.setattr(verify_policy, "LOAD_NONE", 3)
    eager = run_to_completion(Engine(str(hub), device="cuda", dtype=torch.float32, kv_blocks=64, cuda_graphs=False,
                                     max_batch_tokens=24), _requests())
    # a small prefill budget staggers the admissions: the batch is small (drafting) before it is full (overlap)
    spec = Engine(str(hub), device="cuda", dtype=torch.float32, kv_blocks=64, speculative_tokens=2,
                  speculative_policy="adaptive", max_batch_tokens=24)
    assert run_to_completion(spec, _requests()) == eager
    assert spec.overlapped > 0 and spec.spec_drafted > 0
    assert spec.runner.graphs is not None and spec.runner.graphs.graphs
    assert not spec.kv.states
