"""The deterministic mode on a GPU in bf16 (marked gpu: skipped without CUDA), the engine as a worker runs it
(CUDA graphs, overlapped steps, device sampling):

    alone vs in a batch of 7     same tokens, bitwise the same logits
    prefill -> decode vs a migrated continuation (prefill of prompt + k tokens on a fresh engine)
                                 same tokens, bitwise the same logits

with --deterministic (asserted); without it the same checks are printed, not asserted (bf16 kernels are not
batch-invariant: they usually differ). Run with -s to see the report lines ("plain kernels: ...").
DeepSeek-V4 has no batch-invariant kernels yet: the engine refuses the mode for it (checked below).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.random_model import SHAPES, random_llama
from tests import determinism as det

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SHAPE = SHAPES["smollm2-135m"]  # the real shape (30 layers, GQA 9/3, vocab 49152), random weights


@pytest.fixture(scope="module")
def model():
    return random_llama(SHAPE, "cuda", seed=4)


def make(model, deterministic: bool):
    # 64-token steps: the prompts are prefilled in chunks; decode replays CUDA graphs (padded batch buckets)
    return lambda: Engine(model, device="cuda", kv_blocks=512, max_batch_tokens=64, max_running=16,
                          deterministic=deterministic)


def report(name: str, result: tuple[bool, bool, float]) -> None:
    tokens, bitwise, diff = result
    print(f"plain kernels: {name}: tokens equal {tokens}, logits bitwise equal {bitwise}, largest difference {diff:.3g}")


@pytest.mark.parametrize("sampling", [det.GREEDY, det.SEEDED], ids=["greedy", "seeded"])
def test_alone_and_in_a_batch_of_seven(model, sampling) -> None:
    prompt, *others = det.prompts(8, SHAPE.vocab_size, seed=5, lo=20, hi=300)
    on = det.alone_vs_batched(make(model, True), prompt, others, 24, sampling)
    assert on[0] and on[1], f"deterministic mode: largest logit difference {on[2]}"
    report(f"alone vs batch of 7 ({'seeded' if sampling.temperature else 'greedy'})",
           det.alone_vs_batched(make(model, False), prompt, others, 24, sampling))


@pytest.mark.parametrize("k", [1, 17])
def test_migrated_continuation(model, k: int) -> None:
    prompt, *others = det.prompts(8, SHAPE.vocab_size, seed=6, lo=100, hi=300)
    on = det.migrated(make(model, True), prompt, others, 32, k, det.SEEDED)
    assert on[0] and on[1], f"deterministic mode: largest logit difference {on[2]}"
    report(f"migrated after {k} tokens", det.migrated(make(model, False), prompt, others, 32, k, det.SEEDED))


def test_the_mode_uses_graphs_and_its_kernels(model) -> None:
    engine = make(model, True)()
    assert engine.ops.name == "deterministic" and engine.deterministic and engine.model.fused_rows == 0
    det.generate(engine, [det.EngineRequest("a", [5, 6, 7], det.GREEDY, 4)])
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs  # decode replayed from graphs


def test_v4_refuses_the_mode(tmp_path: Path) -> None:
    from tests import v4_checkpoints

    hub = v4_checkpoints.build_hub(tmp_path)
    with pytest.raises(ValueError, match="no batch-invariant kernels for deepseek_v4"):
        Engine(str(hub), device="cuda", kv_blocks=64, deterministic=True)
