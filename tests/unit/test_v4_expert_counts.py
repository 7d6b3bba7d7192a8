"""DeepSeek-V4's per-expert routing counts (expert placement's input): what the engine counts equals a bincount of
the experts transformers' reference routers choose for the same tokens (hash-routed layers included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.schemas.generate import SamplingParams
from tests import v4_checkpoints


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("v4-counts")
    return path, v4_checkpoints.build(path, "mixed")


@torch.no_grad()
def reference_counts(reference, ids: list[int]) -> torch.Tensor:
    """(layers, experts): each reference router's chosen experts over `ids`, bincounted."""
    config = reference.config
    chosen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: chosen.append(out[2].flatten()))
             for layer in reference.model.layers]
    try:
        reference(torch.tensor([ids]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(chosen) == config.num_hidden_layers
    return torch.stack([torch.bincount(c, minlength=config.n_routed_experts) for c in chosen])


def test_counts_equal_a_bincount_of_the_reference_routers_choices(checkpoint) -> None:
    path, reference = checkpoint
    engine = Engine(str(path), kv_blocks=64, max_batch_tokens=16)  # three prefill chunks
    assert engine.expert_counts() is not None and not engine.expert_counts().any()
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    request = EngineRequest("a", ids, SamplingParams(temperature=0.0, max_tokens=1), max_new_tokens=1)
    run_to_completion(engine, [request])  # the prompt's rows, and no decode step (one token, sampled from them)
    assert torch.equal(engine.expert_counts(), reference_counts(reference, ids))
    spec = engine.model.spec
    ex = engine.model.layers[0].experts
    assert engine.expert_bytes * spec.num_experts == ex.w13.nbytes + ex.w2.nbytes

