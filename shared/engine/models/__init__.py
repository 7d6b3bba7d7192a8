"""Model registry: architecture name -> implementation."""

from __future__ import annotations

from typing import Protocol

import torch

from shared.engine.attention import AttentionMetadata
from shared.engine.config import ModelConfig
from shared.engine.kv_cache import CacheSpec, KVCache
from shared.engine.models.deepseek_v4 import DeepseekV4
from shared.engine.models.llama import Llama
from shared.engine.ops import Ops


class CausalLM(Protocol):
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache,
        fed: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def cache_spec(self, block_tokens: int, dtype: torch.dtype) -> CacheSpec: ...


MODELS: dict[str, type] = {"llama": Llama, "deepseek_v4": DeepseekV4}


def build_model(
    config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
    ops: Ops | None = None,
) -> CausalLM:
    cls = MODELS.get(config.arch)
    if cls is None:
        raise ValueError(f"no model implementation for architecture {config.arch!r} (have {sorted(MODELS)})")
    return cls(config, weights, device, dtype, ops)
