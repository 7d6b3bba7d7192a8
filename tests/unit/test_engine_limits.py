"""The engine under the launcher's limits: --max-model-len caps a sequence below the model's context (the GPU
memory share is tests/gpu/test_engine_memory_gpu.py's)."""

from __future__ import annotations

import pytest

from shared.engine.config import ModelConfig
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.random_model import random_llama
from shared.schemas.generate import SamplingParams

TINY = ModelConfig("llama", 384, 128, 2, 4, 2, 32, 256, 10000.0, 1e-5, 256, False, 1, (2,))
GREEDY = SamplingParams(temperature=0, ignore_eos=True)


def test_max_model_len_caps_prompt_and_completion() -> None:
    engine = Engine(random_llama(TINY, "cpu"), kv_blocks=64, max_model_len=40)
    assert engine.max_tokens == 40  # not the model's 256, nor the pool's 64 x 16
    with pytest.raises(ValueError, match="limit 40 tokens"):
        engine.add(EngineRequest("long", list(range(3, 43)), GREEDY, 4))
    out = run_to_completion(engine, [EngineRequest("fits", list(range(3, 33)), GREEDY, 100)])
    assert len(out["fits"]) == 40 - 30  # the completion stops at the cap
    assert Engine(random_llama(TINY, "cpu"), kv_blocks=64).max_tokens == 256
