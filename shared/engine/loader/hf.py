"""HF checkpoint directories: config.json + *.safetensors. Llama loads with its names kept as they are; an
architecture with its own loader (DeepSeek-V4: its own spec, names and quantization) is handed to it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from shared.engine.config import ModelConfig
from shared.engine.loader import deepseek_v4
from shared.model_info import is_deepseek_v4

SUPPORTED = {"LlamaForCausalLM": "llama"}
ARCH_LOADERS: dict[str, Callable[..., tuple[ModelConfig, dict]]] = {
    deepseek_v4.ARCH: deepseek_v4.load,
}


def load(path: Path, keep_quantized: bool = False) -> tuple[ModelConfig, dict]:
    """keep_quantized: an architecture whose loader can keep FP8 / FP4 weights as shipped does (quant.py)."""
    raw = json.loads((path / "config.json").read_text())
    archs = raw.get("architectures") or []
    if is_deepseek_v4(raw.get("model_type", ""), archs):
        archs = [deepseek_v4.ARCH]
    own = next((ARCH_LOADERS[a] for a in archs if a in ARCH_LOADERS), None)
    if own is not None:
        return own(path, keep_quantized=keep_quantized)
    config = llama_config(raw, path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - weights.keys()
    if not config.tie_embeddings:
        missing |= {"lm_head.weight"} - weights.keys()
    if missing:
        raise ValueError(f"{path}: missing tensors {sorted(missing)}")
    return config, weights


def llama_config(raw: dict, path: Path) -> ModelConfig:
    """config.json of a supported HF architecture (SUPPORTED) -> the engine's record."""
    archs = raw.get("architectures") or []
    arch = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise ValueError(f"{path}: architectures {archs} not supported (have {sorted({*SUPPORTED, *ARCH_LOADERS})})")
    # transformers >= 5 moved rope settings into `rope_parameters`; older configs have rope_theta/rope_scaling.
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"{path}: rope type {rope_type!r} is not supported")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    eos = raw.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return ModelConfig(
        arch=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw["intermediate_size"]),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=int(raw.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_id=raw.get("bos_token_id"),
        eos_ids=tuple(sorted(int(t) for t in eos_ids)),
    )
