"""Checkpoint -> (ModelConfig, weights under canonical names), one loader per file format.

Canonical names are the HF Llama ones (`model.layers.N.self_attn.q_proj.weight`, ...) in HF's row layout, so
an HF checkpoint loads as-is and every other format is mapped onto it. Weights stay on the CPU in float32 (or
the checkpoint's float dtype); the model casts and moves them, so one loaded checkpoint can back several
engines in a process. The dummy load format (dummy.py) reads only the config and draws the weights on the
engine's device instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.engine.config import ModelConfig
from shared.engine.loader import dummy, hf
from shared.engine.quant import Weight
from shared.models import ModelFiles


@dataclass(frozen=True)
class LoadedModel:
    name: str  # the model's served name; part of the engine's cache identity
    config: ModelConfig
    # plain tensors; DeepSeek-V4 on a GPU may keep FP8 / FP4 ones (quant.py); dummy's draws each when read
    weights: Mapping[str, Weight]


Loader = Callable[..., tuple[ModelConfig, dict[str, Weight]]]  # (path, keep_quantized=...) -> config, weights


def _load_gguf(path: Path, keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from shared.engine.loader import gguf  # the `gguf` package is only needed for GGUF files

    return gguf.load(path)


LOADERS: dict[str, Loader] = {"gguf": _load_gguf, "hf": hf.load}
LOAD_FORMATS = ("auto", "dummy")  # --load-format: the checkpoint's weights | random ones of its config (dummy.py)


def load(files: ModelFiles, keep_quantized: bool = False, load_format: str = "auto",
         device: torch.device | str = "cpu") -> LoadedModel:
    """keep_quantized: FP8 / FP4 weights stay as the checkpoint ships them where the format's loader can keep
    them (DeepSeek-V4's hub release); otherwise they are dequantized to bfloat16. load_format "dummy": only
    the config is read, the weights are drawn on `device` when the model takes them (dense, or
    quantized as the release ships them where config.json has a quantization_config, kept or dequantized as
    keep_quantized says), under a name of their own (dummy.SUFFIX: the cache id never matches the real
    weights')."""
    if load_format == "dummy":
        config, drawn = dummy.load(files, device, keep_quantized=keep_quantized)
        return LoadedModel(files.name + dummy.SUFFIX, config, drawn)
    if load_format != "auto":
        raise ValueError(f"load format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    loader = LOADERS.get(files.format)
    if loader is None:
        raise ValueError(f"{files.name}: no loader for format {files.format!r} (have {sorted(LOADERS)})")
    config, weights = loader(files.path, keep_quantized=keep_quantized)
    return LoadedModel(files.name, config, weights)
