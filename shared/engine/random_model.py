"""Random-weight Llama models of real shapes (benchmarks and GPU tests: no checkpoint has to travel)."""

from __future__ import annotations

from shared.engine.config import ModelConfig
from shared.engine.loader import LoadedModel
from shared.engine.loader.dummy import RandomWeights, llama_table

SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig("llama", 49152, 576, 30, 9, 3, 64, 1536, 100000.0, 1e-5, 8192, True, 1, (2,)),
    "llama3-8b": ModelConfig("llama", 128256, 4096, 32, 32, 8, 128, 14336, 500000.0, 1e-5, 8192, False, 128000,
                             (128001,)),
    "tiny": ModelConfig("llama", 512, 128, 2, 4, 2, 32, 256, 10000.0, 1e-5, 2048, False, 1, (2,)),
}


def random_llama(config: ModelConfig, device: str, seed: int = 0, name: str = "random") -> LoadedModel:
    """`--load-format dummy`'s Llama weights (loader/dummy.py) for `config` without a config.json: HF tensor
    names, each drawn on `device` from `seed` and its name when the model takes it (fp32; the engine casts)."""
    return LoadedModel(name, config, RandomWeights(llama_table(config), device, seed))
