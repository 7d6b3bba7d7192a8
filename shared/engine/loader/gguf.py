"""GGUF (llama.cpp) checkpoints: metadata -> ModelConfig, tensors dequantized to float32 under HF names."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from shared.engine.config import ModelConfig

SUPPORTED_ARCHS = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def load(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = GGUFReader(path)
    config = _config(reader)
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue  # e.g. rope_freqs for scaled-rope models we reject in _config anyway
        # GGUF lists dims fastest-first; numpy (and torch) want them slowest-first.
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        # np.asarray drops the memmap subclass, whose per-slice bookkeeping doubles dequantization time.
        array = dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(shape)
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only memmap
            array = array.copy()
        weight = torch.from_numpy(array.astype(np.float32, copy=False))
        if name.endswith("q_proj.weight"):
            weight = _unpermute(weight, config.num_heads)
        elif name.endswith("k_proj.weight"):
            weight = _unpermute(weight, config.num_kv_heads)
        weights[name] = weight
    return config, weights


def _config(reader: GGUFReader) -> ModelConfig:
    def field(key: str, default: object = None) -> object:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = str(field("general.architecture"))
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (have {SUPPORTED_ARCHS})")
    if field(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"rope scaling {field(f'{arch}.rope.scaling.type')!r} is not supported")
    hidden = int(field(f"{arch}.embedding_length"))
    heads = int(field(f"{arch}.attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = field(f"{arch}.vocab_size")
    eos = field("tokenizer.ggml.eos_token_id")
    eot = field("tokenizer.ggml.eot_token_id")
    bos = field("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab) if vocab is not None else len(field("tokenizer.ggml.tokens")),  # type: ignore[arg-type]
        hidden_size=hidden,
        num_layers=int(field(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(f"{arch}.rope.dimension_count", hidden // heads)),
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(field(f"{arch}.context_length")),
        tie_embeddings="output.weight" not in names,
        bos_id=None if bos is None else int(bos),
        eos_ids=tuple(sorted({int(t) for t in (eos, eot) if t is not None})),
    )


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row order for a Q or K projection.

    HF orders each head's rows as [first halves of the rotary pairs | second halves] (rotate_half RoPE);
    llama.cpp interleaves them (pair i -> rows 2i, 2i+1). The converter did
    `hf.reshape(n_head, 2, hd/2, in).swapaxes(1, 2)`; this is its inverse.
    """
    out, inp = w.shape
    head_dim = out // n_head
    return w.reshape(n_head, head_dim // 2, 2, inp).transpose(1, 2).reshape(out, inp)
