"""Checkpoint -> (ModelConfig, weights under canonical names), one loader per file format.

Canonical names are the HF Llama ones (`model.layers.N.self_attn.q_proj.weight`, ...) in HF's row layout, so
an HF checkpoint loads as-is and every other format is mapped onto it. Weights stay on the CPU in float32 (or
the checkpoint's float dtype); the model casts and moves them, so one loaded checkpoint can back several
engines in a process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.engine.config import ModelConfig
from shared.engine.loader import hf
from shared.engine.quant import Weight
from shared.models import ModelFiles


@dataclass(frozen=True)
class LoadedModel:
    name: str  # the model's served name; part of the engine's cache identity
    config: ModelConfig
    weights: dict[str, Weight]  # plain tensors; DeepSeek-V4 on a GPU may keep FP8 / FP4 ones (quant.py)


Loader = Callable[..., tuple[ModelConfig, dict[str, Weight]]]  # (path, keep_quantized=...) -> config, weights


def _load_gguf(path: Path, keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from shared.engine.loader import gguf  # the `gguf` package is only needed for GGUF files

    return gguf.load(path)


LOADERS: dict[str, Loader] = {"gguf": _load_gguf, "hf": hf.load}


def load(files: ModelFiles, keep_quantized: bool = False) -> LoadedModel:
    """keep_quantized: FP8 / FP4 weights stay as the checkpoint ships them where the format's loader can keep
    them (DeepSeek-V4's hub release); otherwise they are dequantized to bfloat16."""
    loader = LOADERS.get(files.format)
    if loader is None:
        raise ValueError(f"{files.name}: no loader for format {files.format!r} (have {sorted(LOADERS)})")
    config, weights = loader(files.path, keep_quantized=keep_quantized)
    return LoadedModel(files.name, config, weights)
