"""Tiny random DeepSeek-V4 checkpoints made with transformers' reference implementation (a test-only dependency).

Each config is small enough to run on a CPU in well under a second, yet exercises what the real model does:
all three attention kinds, hash-routed MoE layers, o_groups > 1, a short sliding window and small compression
ratios so a 40-token prompt already closes several compressor windows, and index_topk at least the number of
compressed entries (top-k near-ties flip between the batched and incremental paths; the reference compares
that way too). transformers initialises sinks, position biases, hyper-connection biases, router biases and the
hash table to zeros; `build` draws them at random so every code path is live.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BASE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    moe_intermediate_size=32,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=48,
    partial_rotary_factor=0.5,
    num_experts_per_tok=2,
    n_routed_experts=8,
    n_shared_experts=1,
    sliding_window=8,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=64,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    max_position_embeddings=512,
    initializer_range=0.15,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
)

S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

CONFIGS: dict[str, dict[str, Any]] = {
    # every layer kind, one hash layer, YaRN on the compressed branches
    "mixed": dict(
        num_hidden_layers=4,
        layer_types=[S, C, H, C],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                         "beta_fast": 32, "beta_slow": 1},
    ),
    # HCA first (as V4-Pro bootstraps), two hash layers, more groups, a wider window
    "hca_first": dict(
        num_hidden_layers=3,
        layer_types=[H, C, H],
        mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        o_groups=4,
        sliding_window=12,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    ),
}


def build(path: Path, name: str = "mixed", seed: int = 0, **overrides: Any):
    """Save a random checkpoint of config `name` to `path` (save_pretrained's dialect); returns the model."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(**{**BASE, **CONFIGS[name], **overrides})
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for mod_name, tensor in model.named_parameters():
            if mod_name.endswith(("sinks", "position_bias")):
                tensor.copy_(torch.randn(tensor.shape, generator=g))
            elif mod_name.endswith((".base", "hc_base")):
                tensor.copy_(0.5 * torch.randn(tensor.shape, generator=g))
        for mod_name, buf in model.named_buffers():
            if mod_name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))
            elif mod_name.endswith("tid2eid"):
                experts, k = config.n_routed_experts, config.num_experts_per_tok
                rows = [torch.randperm(experts, generator=g)[:k] for _ in range(buf.shape[0])]
                buf.copy_(torch.stack(rows))
    model.save_pretrained(path)
    return model
