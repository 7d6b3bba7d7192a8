"""The deterministic mode end to end on a tiny random Llama (tests/determinism.py): a request alone vs in a batch
of 7, and prefill -> decode vs a migrated continuation, give the same tokens and bitwise the same logits.

On a CPU the mode's Triton kernels run under TRITON_INTERPRET=1 in fp32 (kernels="deterministic"); the GPU
version in bf16 is tests/gpu/test_deterministic_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from shared.engine.config import ModelConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.random_model import random_llama  # noqa: E402
from tests import determinism as det  # noqa: E402

# one layer, two query heads on one KV head: the interpreter runs every Triton program in Python
TINY = ModelConfig("llama", 256, 64, 1, 2, 1, 32, 128, 10000.0, 1e-5, 512, False, 1, (2,))


@pytest.fixture(scope="module")
def model():
    return random_llama(TINY, "cpu", seed=3)


def engine(model) -> Engine:
    # 20-token steps: prompts are prefilled in chunks, next to other sequences' chunks and decode rows
    return Engine(model, device="cpu", kernels="deterministic", kv_blocks=48, max_batch_tokens=20, max_running=8,
                  vocabulary=lambda: [b"x"] * TINY.vocab_size)


# bitwise only with the compiled kernels (tests/unit/test_invariant_kernels.py COMPILED says why)
COMPILED = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="bitwise invariance needs the compiled kernels (interpreter: BLAS)")


@COMPILED
def test_alone_and_in_a_batch_of_seven_are_bitwise_equal(model) -> None:
    prompt, *others = det.prompts(8, TINY.vocab_size, seed=1, lo=3, hi=30)
    tokens, bitwise, diff = det.alone_vs_batched(lambda: engine(model), prompt, others, 4, det.SEEDED)
    assert tokens and bitwise, f"largest logit difference {diff}"


@COMPILED
def test_migrated_continuation_is_bitwise_equal(model) -> None:
    """The continuation prefills prompt + 3 tokens in 20-token chunks; the first run decoded those positions."""
    prompt, *others = det.prompts(3, TINY.vocab_size, seed=2, lo=22, hi=30)
    tokens, bitwise, diff = det.migrated(lambda: engine(model), prompt, others, 6, 3, det.GREEDY)
    assert tokens and bitwise, f"largest logit difference {diff}"


def test_deterministic_flag_picks_the_backend(model) -> None:
    """Engine(deterministic=True): the invariant kernels where Triton runs for real; the CPU keeps torch's ops."""
    cpu = Engine(model, device="cpu", deterministic=True, kv_blocks=8, vocabulary=lambda: [b"x"] * TINY.vocab_size)
    assert cpu.ops.name == "torch" and not cpu.deterministic
    with pytest.raises(ValueError, match="Triton"):
        Engine(model, device="cpu", deterministic=True, kernels="torch", kv_blocks=8)
