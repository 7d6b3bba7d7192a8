"""The model's shape, as the engine needs it: one frozen record built by a loader from the checkpoint's metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # model registry key, e.g. "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_eps: float
    max_position: int  # context length: prompt + generated tokens
    tie_embeddings: bool  # lm_head shares the token embedding matrix
    bos_id: int | None
    eos_ids: tuple[int, ...]
    spec: Any = None  # the architecture's own record where Llama's fields do not say it all (DeepseekV4Spec)

    def __post_init__(self) -> None:
        sizes = (self.vocab_size, self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads,
                 self.head_dim, self.intermediate_size, self.max_position)
        if min(sizes) < 1:
            raise ValueError(f"model sizes must be positive: {self}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {self.head_dim}")
