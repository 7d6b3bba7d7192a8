"""What the engine learns of a model through shared/engine/protocols.py: Llama has neither its own cache nor a
draft layer; DeepSeek-V4 makes its own cache and drafts only when its checkpoint has an MTP layer."""

from __future__ import annotations

import pytest

from bench import v4_model
from shared.engine.engine import Engine
from shared.engine.loader import LoadedModel
from shared.engine.loader.deepseek_v4 import parse_spec
from shared.engine.loader.dummy import RandomWeights, v4_table
from shared.engine.models.deepseek_v4.cache import V4Cache
from shared.engine.protocols import HasOwnCache, drafter
from shared.engine.random_model import SHAPES, random_llama


def test_llama_gets_kv_pages_and_cannot_draft() -> None:
    engine = Engine(random_llama(SHAPES["tiny"], "cpu"), kv_blocks=8)
    assert not isinstance(engine.model, HasOwnCache) and drafter(engine.model) is None
    assert engine.kv.backtrack > 0 and engine.replay_tokens == 0  # paged K/V: a rejected draft is overwritten
    with pytest.raises(ValueError, match="no MTP layer"):
        Engine(random_llama(SHAPES["tiny"], "cpu"), kv_blocks=8, speculative_tokens=1)


def test_v4_makes_its_own_cache_and_without_mtp_cannot_draft() -> None:
    spec = parse_spec(v4_model.hf_config(3, 16, tiny=True).to_dict())  # no MTP layer
    loaded = LoadedModel("tiny-v4", v4_model.model_config(spec), RandomWeights(v4_table(spec), "cpu"))
    engine = Engine(loaded, kv_blocks=8)
    assert isinstance(engine.model, HasOwnCache) and isinstance(engine.kv, V4Cache)
    assert drafter(engine.model) is None and engine.replay_tokens == spec.num_layers * (spec.window - 1)
    with pytest.raises(ValueError, match="no MTP layer"):
        Engine(loaded, kv_blocks=8, speculative_tokens=1)
