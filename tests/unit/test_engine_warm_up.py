"""Engine.warm_up_prefill (a prefill worker at start-up, on a GPU): it runs a cold prompt, a follow-up on a
snapshot and one on a replay, then leaves nothing a request could meet: no cached prefix, no held block, and the
next requests' tokens are those of an engine that never warmed up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.schemas.generate import SamplingParams
from tests import v4_checkpoints

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return v4_checkpoints.build_hub(tmp_path_factory.mktemp("v4"))


def _requests() -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(i)).tolist(),
                          GREEDY, max_new_tokens=8, stop_token_ids=[]) for i, n in enumerate((5, 70, 23))]


def test_prefill_warm_up_leaves_nothing_behind(hub: Path) -> None:
    cold = run_to_completion(Engine(str(hub), kv_blocks=64), _requests())
    engine = Engine(str(hub), kv_blocks=64)
    free = engine.blocks.num_free
    bt = engine.block_tokens
    tokens = engine.warm_up_prefill()
    n = 2 * bt + 37
    assert tokens == n + (n + 1 + 45) + (2 * bt + 51)  # the three prompts ran
    assert engine.blocks.cached_hashes() == [] and engine.blocks.num_free == free
    assert not engine.has_work() and not engine.scheduler.seqs
    assert run_to_completion(engine, _requests()) == cold


def test_prefill_warm_up_declines_a_pool_too_small(hub: Path) -> None:
    engine = Engine(str(hub), kv_blocks=4)
    assert engine.warm_up_prefill() == 0
