"""DeepSeek-V4's shape: everything the model and its cache need, parsed once from config.json by the loader.

One record for both checkpoint dialects (the hub's `compress_ratios` / `num_hash_layers` / `rope_scaling`, and
transformers' `layer_types` / `compress_rates` / `mlp_layer_types` / `rope_parameters`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SLIDING, CSA, HCA = "sliding", "csa", "hca"  # attention kinds: window only; + sparse compressed; + heavy compressed


@dataclass(frozen=True)
class DeepseekV4Spec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int  # one shared K = V head of this width
    rope_head_dim: int  # the trailing channels of each head that get (interleaved) RoPE
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int  # sliding window, tokens (the query included)
    kinds: tuple[str, ...]  # per layer: SLIDING | CSA | HCA
    ratios: tuple[int, ...]  # per layer: 0 for SLIDING, else tokens per compressed entry
    hash_layers: int  # the first `hash_layers` MoE layers route by the token-id table tid2eid
    index_heads: int
    index_head_dim: int
    index_topk: int
    num_experts: int
    experts_per_token: int
    num_shared_experts: int
    moe_intermediate: int
    scoring: str  # router activation: "sqrtsoftplus" | "softmax" | "sigmoid"
    norm_topk_prob: bool
    routed_scale: float
    swiglu_limit: float
    hc_mult: int  # parallel residual streams (mHC)
    hc_iters: int  # Sinkhorn-Knopp iterations
    hc_eps: float
    rope_theta: float  # sliding-only layers
    compress_rope_theta: float  # CSA / HCA layers, their compressors and the indexer
    compress_rope_scaling: dict[str, Any] | None  # YaRN parameters of the compressed branches, None = plain
    rms_eps: float
    max_position: int
    num_mtp_layers: int
    mtp_kinds: tuple[str, ...]  # attention kind of each MTP layer
    mtp_ratios: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.kinds) == len(self.ratios) == self.num_layers:
            raise ValueError(f"{self.num_layers} layers but {len(self.kinds)} kinds / {len(self.ratios)} ratios")
        for kind, ratio in zip(self.kinds + self.mtp_kinds, self.ratios + self.mtp_ratios):
            if kind not in (SLIDING, CSA, HCA) or (ratio == 0) != (kind == SLIDING) or ratio < 0:
                raise ValueError(f"attention kind {kind!r} with compress ratio {ratio}")
        if self.rope_head_dim % 2 or not 0 < self.rope_head_dim <= min(self.head_dim, self.index_head_dim):
            raise ValueError(f"rope_head_dim {self.rope_head_dim} must be even and fit head_dim / index_head_dim")
        if self.num_heads * self.head_dim % self.o_groups:
            raise ValueError(f"o_groups {self.o_groups} must divide num_heads * head_dim")
        if self.experts_per_token > self.num_experts:
            raise ValueError("experts_per_token exceeds num_experts")

    @property
    def block_tokens(self) -> int:
        """Tokens per long-term cache block: a multiple of every compress ratio (and of 16), so a block always
        holds whole compressed entries. 128 for V4-Flash and V4-Pro."""
        return math.lcm(16, *(r for r in self.ratios if r))
