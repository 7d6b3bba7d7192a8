"""Llama: RMSNorm, rotary embeddings (rotate-half layout), grouped-query attention, SwiGLU MLP.

Inference only, so weights are plain tensors rather than nn.Parameters. Q/K/V and gate/up are fused into one
matmul each: fewer, larger GEMMs over the flattened batch. Norms and softmax run in float32 whatever the
weight dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.engine.attention import AttentionMetadata, paged_attention
from shared.engine.config import ModelConfig
from shared.engine.kv_cache import CacheSpec, KVCache, PagedSpec


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # (D,)
    qkv: torch.Tensor  # ((H + 2 KV) * hd, D)
    o: torch.Tensor  # (D, H * hd)
    mlp_norm: torch.Tensor  # (D,)
    gate_up: torch.Tensor  # (2 I, D)
    down: torch.Tensor  # (D, I)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rotary_tables(head_dim: int, max_position: int, theta: float, device: torch.device) -> torch.Tensor:
    """(max_position, 2, head_dim / 2) float32: cos and sin of position * theta^(-2i / head_dim)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.arange(max_position, dtype=torch.float64, device=device)[:, None] * inv_freq  # (P, hd/2)
    return torch.stack([angles.cos(), angles.sin()], dim=1).float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, hd); cos, sin (T, 1, hd/2). Pairs are (x[i], x[i + hd/2]) (HF's rotate_half layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Llama:
    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.dtype = dtype

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
        self.rope = rotary_tables(config.head_dim, config.max_position, config.rope_theta, device)
        self.scale = config.head_dim**-0.5

    def cache_spec(self, block_tokens: int, dtype: torch.dtype) -> CacheSpec:
        c = self.config
        return CacheSpec(PagedSpec(c.num_layers, c.num_kv_heads, c.head_dim, block_tokens, dtype), 0)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden states (T, D) before the final norm."""
        c = self.config
        T = input_ids.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        cos, sin = self.rope[positions].unsqueeze(2).unbind(1)  # each (T, 1, hd/2)
        x = self.embed[input_ids]  # (T, D)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, c.rms_eps)
            q, k, v = F.linear(h, layer.qkv).split([q_size, kv_size, kv_size], dim=-1)
            q = apply_rotary(q.view(T, c.num_heads, c.head_dim), cos, sin)  # (T, H, hd)
            k = apply_rotary(k.view(T, c.num_kv_heads, c.head_dim), cos, sin)  # (T, KV, hd)
            kv.write(i, k, v.view(T, c.num_kv_heads, c.head_dim), meta.slot_mapping)
            k_cache, v_cache = kv.layer(i)
            o = paged_attention(q, k_cache, v_cache, meta, self.scale)  # (T, H, hd)
            x = x + F.linear(o.reshape(T, q_size), layer.o)
            h = rms_norm(x, layer.mlp_norm, c.rms_eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)  # each (T, I)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, D) of the positions we sample from -> (N, V) float32."""
        return F.linear(rms_norm(hidden, self.norm, self.config.rms_eps), self.lm_head).float()
