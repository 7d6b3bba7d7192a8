"""Random-weight Llama models of real shapes (benchmarks and GPU tests: no checkpoint has to travel)."""

from __future__ import annotations

import torch

from shared.engine.config import ModelConfig
from shared.engine.loader import LoadedModel

SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig("llama", 49152, 576, 30, 9, 3, 64, 1536, 100000.0, 1e-5, 8192, True, 1, (2,)),
    "llama3-8b": ModelConfig("llama", 128256, 4096, 32, 32, 8, 128, 14336, 500000.0, 1e-5, 8192, False, 128000,
                             (128001,)),
    "tiny": ModelConfig("llama", 512, 128, 2, 4, 2, 32, 256, 10000.0, 1e-5, 2048, False, 1, (2,)),
}


def random_llama(config: ModelConfig, device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 name: str = "random") -> LoadedModel:
    """Weights ~ N(0, 0.02) (norms ~ 1), drawn on `device` in `dtype`, under HF tensor names."""
    c = config
    g = torch.Generator(device=device).manual_seed(seed)
    hd, D, I = c.head_dim, c.hidden_size, c.intermediate_size

    def rand(*shape: int, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=dtype) * 0.02 + mean)

    w = {"model.embed_tokens.weight": rand(c.vocab_size, D), "model.norm.weight": rand(D, mean=1.0)}
    if not c.tie_embeddings:
        w["lm_head.weight"] = rand(c.vocab_size, D)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": rand(D, mean=1.0), p + "post_attention_layernorm.weight": rand(D, mean=1.0),
            p + "self_attn.q_proj.weight": rand(c.num_heads * hd, D),
            p + "self_attn.k_proj.weight": rand(c.num_kv_heads * hd, D),
            p + "self_attn.v_proj.weight": rand(c.num_kv_heads * hd, D), p + "self_attn.o_proj.weight": rand(D, c.num_heads * hd),
            p + "mlp.gate_proj.weight": rand(I, D), p + "mlp.up_proj.weight": rand(I, D), p + "mlp.down_proj.weight": rand(D, I),
        }
    return LoadedModel(name, c, w)
