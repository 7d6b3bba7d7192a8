"""Llama: RMSNorm, rotary embeddings (rotate-half layout), grouped-query attention, SwiGLU MLP.

Inference only, so weights are plain tensors rather than nn.Parameters. Q/K/V and gate/up are fused into one
matmul each: fewer, larger GEMMs over the flattened batch. Norms and softmax run in float32 whatever the
weight dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.attention import AttentionMetadata
from shared.engine.config import ModelConfig
from shared.engine.kv_cache import CacheSpec, KVCache, PagedSpec
from shared.engine.ops import Ops, TorchOps, apply_rotary, rms_norm

__all__ = ["Llama", "LayerWeights", "apply_rotary", "rms_norm", "rotary_tables"]

FUSED_MAX_HIDDEN = 2048  # hidden sizes up to this take the fused GEMV forward at T <= ops.gemv_rows


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # (D,)
    qkv: torch.Tensor  # ((H + 2 KV) * hd, D)
    o: torch.Tensor  # (D, H * hd)
    mlp_norm: torch.Tensor  # (D,)
    gate_up: torch.Tensor  # (2 I, D)
    down: torch.Tensor  # (D, I)


def rotary_tables(head_dim: int, max_position: int, theta: float, device: torch.device) -> torch.Tensor:
    """(max_position, 2, head_dim / 2) float32: cos and sin of position * theta^(-2i / head_dim)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.arange(max_position, dtype=torch.float64, device=device)[:, None] * inv_freq  # (P, hd/2)
    return torch.stack([angles.cos(), angles.sin()], dim=1).float()


class Llama:
    batch_invariant = True  # every op goes through self.ops: the deterministic backend covers the whole forward

    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
        ops: Ops | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.ops: Ops = ops or TorchOps()

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint has no tensor {name}")
            return weights[name].to(device=device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")  # (V, D)
        self.lm_head = self.embed if config.tie_embeddings else w("lm_head.weight")  # (V, D)
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(LayerWeights(
                attn_norm=w(p + "input_layernorm.weight"),
                qkv=torch.cat([w(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
                o=w(p + "self_attn.o_proj.weight"),
                mlp_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                down=w(p + "mlp.down_proj.weight"),
            ))
        # The fused small-batch path pays off where launches dominate (SmolLM2: ~300 kernels a step); at the
        # 8B's size its Triton GEMVs read slower than cuBLAS (H200: 151 vs 220 tok/s at batch 1), so not there.
        self.fused_rows = self.ops.gemv_rows if config.hidden_size <= FUSED_MAX_HIDDEN else 0
        self.rope = rotary_tables(config.head_dim, config.max_position, config.rope_theta, device)
        self.scale = config.head_dim**-0.5

    def cache_spec(self, block_tokens: int, dtype: torch.dtype) -> CacheSpec:
        c = self.config
        return CacheSpec(PagedSpec(c.num_layers, c.num_kv_heads, c.head_dim, block_tokens, dtype), 0)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache,
        fed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden states (T, D) before the final norm. An id -(r + 1) is a
        placeholder for fed[r] (a token sampled by the previous step, still on the device)."""
        c, ops = self.config, self.ops
        T = input_ids.shape[0]
        heads = (c.num_heads, c.num_kv_heads, c.head_dim)
        x = ops.embed(input_ids, self.embed, fed)  # (T, D) the residual stream
        if T <= self.fused_rows:
            return self._forward_fused(x, positions, meta, kv)
        h, x = ops.rms_norm(x, None, self.layers[0].attn_norm, c.rms_eps)
        for i, layer in enumerate(self.layers):
            q = ops.rope_write(ops.linear(h, layer.qkv), positions, self.rope, kv, i, meta, heads)  # (T, H, hd)
            o = ops.attention(q, kv, i, meta, self.scale)  # (T, H, hd)
            h, x = ops.rms_norm(x, ops.linear(o.reshape(T, -1), layer.o), layer.mlp_norm, c.rms_eps)
            down = ops.linear(ops.silu_mul(ops.linear(h, layer.gate_up)), layer.down)  # (T, D)
            if i + 1 < len(self.layers):
                h, x = ops.rms_norm(x, down, self.layers[i + 1].attn_norm, c.rms_eps)  # x += down; next norm
            else:
                x = x + down
        return x

    def _forward_fused(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache
                       ) -> torch.Tensor:
        """The same layers for a few rows (batch-1..8 decode): each norm rides in the next linear layer's
        prologue, each residual add in the epilogue of the one before, SwiGLU in gate_up's: 4 GEMVs and the
        attention kernels per layer, nothing else."""
        c, ops = self.config, self.ops
        T, eps = x.shape[0], c.rms_eps
        heads = (c.num_heads, c.num_kv_heads, c.head_dim)
        for i, layer in enumerate(self.layers):
            qkv = ops.norm_linear(x, layer.attn_norm, eps, layer.qkv)  # (T, (H + 2 KV) hd)
            q = ops.rope_write(qkv, positions, self.rope, kv, i, meta, heads)  # (T, H, hd)
            o = ops.attention(q, kv, i, meta, self.scale)  # (T, H, hd)
            x = ops.linear_residual(o.reshape(T, -1), layer.o, x)  # x += o Wo^T
            x = ops.linear_residual(ops.norm_swiglu(x, layer.mlp_norm, eps, layer.gate_up), layer.down, x)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, D) of the positions we sample from -> (N, V) float32."""
        h, _ = self.ops.rms_norm(hidden.contiguous(), None, self.norm, self.config.rms_eps)
        return self.ops.lm_head(h, self.lm_head)
