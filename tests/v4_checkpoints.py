"""Tiny random DeepSeek-V4 checkpoints made with transformers' reference implementation (a test-only dependency).

Each config is small enough to run on a CPU in well under a second, yet exercises what the real model does:
all three attention kinds, hash-routed MoE layers, o_groups > 1, a short sliding window and small compression
ratios so a 40-token prompt already closes several compressor windows, and index_topk at least the number of
compressed entries (top-k near-ties flip between the batched and incremental paths; the reference compares
that way too). transformers initialises sinks, position biases, hyper-connection biases, router biases and the
hash table to zeros; `build` draws them at random so every code path is live.
"""

from __future__ import annotations

import json
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


# ---- the official hub dialect ---------------------------------------------------------------------------------
# Written from the transformers modules attribute by attribute, so the names are checked against an account of
# the mapping that shares nothing with transformers' conversion table or with the loader's inverse of it.

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
FP8_BLOCK = 32  # tiny shapes: 32x32 blocks, so several tensors end in partial blocks (48 rows, 48 or 2 columns)
FP4_BLOCK = 32  # columns per FP4 scale


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's tensors under the official hub names (no MTP). Expert entries are views of the stacked
    transformers parameters, so writing into them writes into the model."""
    m = model.model
    out = {"embed.weight": m.embed_tokens.weight, "head.weight": model.lm_head.weight, "norm.weight": m.norm.weight,
           "hc_head_fn": m.hc_head.hc_fn, "hc_head_base": m.hc_head.hc_base, "hc_head_scale": m.hc_head.hc_scale}
    for i, layer in enumerate(m.layers):
        out |= _hub_layer(f"layers.{i}", layer)
    return {name: tensor.detach() for name, tensor in out.items()}


def _hub_layer(p: str, layer) -> dict[str, torch.Tensor]:
    a, f = layer.self_attn, layer.mlp
    out = {f"{p}.attn_norm.weight": layer.input_layernorm.weight,
           f"{p}.ffn_norm.weight": layer.post_attention_layernorm.weight}
    for part, hc in (("attn", layer.attn_hc), ("ffn", layer.ffn_hc)):
        out |= {f"{p}.hc_{part}_fn": hc.fn, f"{p}.hc_{part}_base": hc.base, f"{p}.hc_{part}_scale": hc.scale}
    out |= {f"{p}.attn.wq_a.weight": a.q_a_proj.weight, f"{p}.attn.q_norm.weight": a.q_a_norm.weight,
            f"{p}.attn.wq_b.weight": a.q_b_proj.weight, f"{p}.attn.wkv.weight": a.kv_proj.weight,
            f"{p}.attn.kv_norm.weight": a.kv_norm.weight, f"{p}.attn.wo_a.weight": a.o_a_proj.weight,
            f"{p}.attn.wo_b.weight": a.o_b_proj.weight, f"{p}.attn.attn_sink": a.sinks}
    compressors = [] if a.compressor is None else [("attn.compressor", a.compressor)]
    indexer = getattr(a.compressor, "indexer", None)  # CSA only
    if indexer is not None:
        compressors.append(("attn.indexer.compressor", indexer))
        out |= {f"{p}.attn.indexer.wq_b.weight": indexer.q_b_proj.weight,
                f"{p}.attn.indexer.weights_proj.weight": indexer.scorer.weights_proj.weight}
    for name, c in compressors:
        out |= {f"{p}.{name}.wkv.weight": c.kv_proj.weight, f"{p}.{name}.wgate.weight": c.gate_proj.weight,
                f"{p}.{name}.ape": c.position_bias, f"{p}.{name}.norm.weight": c.kv_norm.weight}
    out[f"{p}.ffn.gate.weight"] = f.gate.weight
    if f.is_hash:
        out[f"{p}.ffn.gate.tid2eid"] = f.gate.tid2eid
    else:
        out[f"{p}.ffn.gate.bias"] = f.gate.e_score_correction_bias
    gate_up, down = f.experts.gate_up_proj, f.experts.down_proj  # (E, 2I, D), (E, D, I)
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        x = f"{p}.ffn.experts.{e}"
        out |= {f"{x}.w1.weight": gate_up[e, :inter], f"{x}.w3.weight": gate_up[e, inter:], f"{x}.w2.weight": down[e]}
    s, x = f.shared_experts, f"{p}.ffn.shared_experts"
    out |= {f"{x}.w1.weight": s.gate_proj.weight, f"{x}.w2.weight": s.down_proj.weight,
            f"{x}.w3.weight": s.up_proj.weight}
    return out


def _mtp_tensors(model, seed: int) -> dict[str, torch.Tensor]:
    """One MTP layer as DeepSeek releases it: window-only attention (their compress_ratios end in 0), a routed
    MoE shaped like the last layer's, plus the MTP projections, norms and head collapse. Values are small e2m1
    codes, which FP8 and FP4 both hold exactly."""
    config = model.config
    last = config.num_hidden_layers - 1
    assert config.mlp_layer_types[last] == "moe"
    d, hc = config.hidden_size, config.hc_mult
    shapes = {"e_proj.weight": (d, d), "h_proj.weight": (d, d), "enorm.weight": (d,), "hnorm.weight": (d,),
              "norm.weight": (d,), "hc_head_fn": (hc, hc * d), "hc_head_base": (hc,), "hc_head_scale": (1,)}
    for name, tensor in hub_state_dict(model).items():
        parts = name.split(".", 2)
        if parts[0] != "layers" or ".compressor." in parts[2] or ".indexer." in parts[2]:
            continue
        if int(parts[1]) == (last if parts[2].startswith("ffn.") else 0):
            shapes[parts[2]] = tuple(tensor.shape)
    g = torch.Generator().manual_seed(seed)
    scale = {"e_proj.weight": d**-0.5, "h_proj.weight": d**-0.5}  # keep the MTP block's input near unit scale
    return {f"mtp.0.{leaf}": E2M1[torch.randint(16, shape, generator=g)] / 4 * (4 * scale[leaf] if leaf in scale
                                                                                 else 1)
            for leaf, shape in shapes.items()}


def quantized_kind(name: str, tensor: torch.Tensor) -> str | None:
    """What save_hub_dialect(quantize=True) does to a tensor: routed experts FP4, other 2-D linears FP8 (not the
    embedding, nor the router, which the loader must then pass through untouched)."""
    if ".ffn.experts." in name:
        return "fp4"
    if tensor.dim() == 2 and name.endswith(".weight") and name != "embed.weight" and not name.endswith("gate.weight"):
        return "fp8"
    return None


def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Power-of-two scales (ue8m0-style, as V4 ships): a representable weight then quantizes without loss."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-30) / top)))


def fp8_quantize(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale per block x block; partial blocks at the ends)."""
    rows, cols = w.shape
    grid = (-(-rows // block), -(-cols // block))
    padded = torch.nn.functional.pad(w.abs(), (0, grid[1] * block - cols, 0, grid[0] * block - rows))
    scale = _pow2_scale(padded.view(grid[0], block, grid[1], block).amax(dim=(1, 3)), 448.0)
    q = (w / expand_scale(scale, rows, cols, block, block)).to(torch.float8_e4m3fn)
    return q, scale.float()


def fp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, two e2m1 codes a byte, low nibble = even column; float8_e8m0fnu scale per FP4_BLOCK columns)."""
    rows, cols = w.shape
    scale = _pow2_scale(w.abs().view(rows, cols // FP4_BLOCK, FP4_BLOCK).amax(-1), 6.0)
    x = w / expand_scale(scale, rows, cols, 1, FP4_BLOCK)
    codes = (x.unsqueeze(-1) - E2M1).abs().argmin(-1)  # nearest e2m1 value
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def expand_scale(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    return scale.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]


def make_representable(model) -> None:
    """Round every tensor save_hub_dialect quantizes onto its quantization grid, in place, so that quantizing
    and dequantizing it again is exact (and the values are exact in bfloat16)."""
    with torch.no_grad():
        for name, tensor in hub_state_dict(model).items():
            kind = quantized_kind(name, tensor)
            if kind == "fp8":
                q, scale = fp8_quantize(tensor)
                tensor.copy_(q.float() * expand_scale(scale, *tensor.shape, FP8_BLOCK, FP8_BLOCK))
            elif kind == "fp4":
                packed, scale = fp4_quantize(tensor)
                codes = packed.view(torch.uint8).long()
                values = torch.stack((E2M1[codes & 0xF], E2M1[codes >> 4]), dim=-1).flatten(-2)
                tensor.copy_(values * expand_scale(scale, *tensor.shape, 1, FP4_BLOCK))


def save_hub_dialect(model, path: Path, quantize: bool = False) -> dict[str, torch.Tensor]:
    """Write `model` as DeepSeek's own release spells it: official config keys (compress_ratios with one MTP entry,
    num_hash_layers, qk_rope_head_dim, rope_scaling) and official tensor names plus a fake MTP layer; with
    `quantize`, FP8 linears with `.scale` and FP4 routed experts. Two shards, the scales in the second, and an
    index the loader need not read. Returns the tensors a loader should give back (before quantization)."""
    from safetensors.torch import save_file

    config = model.config
    compress = config.rope_parameters["compress"]
    raw: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "moe_intermediate_size": config.moe_intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": 1, "head_dim": config.head_dim,
        "q_lora_rank": config.q_lora_rank, "qk_rope_head_dim": int(config.head_dim * config.partial_rotary_factor),
        "num_experts_per_tok": config.num_experts_per_tok, "n_routed_experts": config.n_routed_experts,
        "n_shared_experts": config.n_shared_experts, "scoring_func": config.scoring_func,
        "norm_topk_prob": config.norm_topk_prob, "routed_scaling_factor": config.routed_scaling_factor,
        "max_position_embeddings": config.max_position_embeddings, "rope_theta": config.rope_theta,
        "compress_rope_theta": config.compress_rope_theta,
        "compress_ratios": [0 if t == S else config.compress_rates[t] for t in config.layer_types] + [0],
        "num_hash_layers": config.mlp_layer_types.count("hash_moe"), "num_nextn_predict_layers": 1,
        "sliding_window": config.sliding_window, "o_groups": config.o_groups, "o_lora_rank": config.o_lora_rank,
        "index_n_heads": config.index_n_heads, "index_head_dim": config.index_head_dim,
        "index_topk": config.index_topk, "hc_mult": config.hc_mult, "hc_sinkhorn_iters": config.hc_sinkhorn_iters,
        "hc_eps": config.hc_eps, "swiglu_limit": config.swiglu_limit, "rms_norm_eps": config.rms_norm_eps,
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "tie_word_embeddings": False,
    }
    if compress["rope_type"] == "yarn":
        yarn_keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
        raw["rope_scaling"] = {"type": "yarn", **{k: compress[k] for k in yarn_keys}}
    if quantize:
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    truth = {name: t.clone() for name, t in hub_state_dict(model).items()} | _mtp_tensors(model, seed=7)
    weights, scales = {}, {}
    for name, tensor in truth.items():
        kind = quantized_kind(name, tensor) if quantize else None
        if kind is None:
            weights[name] = tensor
            continue
        weights[name], scales[name.removesuffix(".weight") + ".scale"] = (
            fp8_quantize(tensor) if kind == "fp8" else fp4_quantize(tensor))
    shards = {"model-00001-of-00002.safetensors": weights, "model-00002-of-00002.safetensors": scales}
    for file, tensors in shards.items():
        if tensors:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / file))
    index = {"weight_map": {name: file for file, tensors in shards.items() for name in tensors}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return truth


# ---- a served checkpoint ----------------------------------------------------------------------------------------
# What the CLI and mesh tests serve: the real vocabulary (129,280 ids: every id the V4 tokenizer makes is a valid
# input, and the head samples over all of them), a 4,096-token context and the real models' 128-token long-term
# block (HCA ratio 128, so engine.block_tokens is 128, not shared.hashing's 16). The embedding and head make it
# about 70 MB; transformers builds it in a few seconds.

SERVED_NAME = "DeepSeek-V4-Pro"  # the directory's name is the served name; deepseek-recipe knows this one as V4
SERVED: dict[str, Any] = dict(
    vocab_size=129280,
    max_position_embeddings=4096,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                     "beta_fast": 32, "beta_slow": 1},  # 4 x 1024 = the context, as transformers expects
)


def served_config():
    """The served checkpoint's transformers config (what build_served saves as its config.json)."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{**BASE, **CONFIGS["mixed"], **SERVED})


def build_served(root: Path, seed: int = 0) -> Path:
    """A servable tiny checkpoint at `root / SERVED_NAME` (config.json + safetensors, no tokenizer.json: it is
    served with the packaged V4 tokenizer); returns its directory."""
    path = root / SERVED_NAME
    build(path, "mixed", seed=seed, **SERVED)
    return path


def build_hub(root: Path, name: str = "mixed") -> Path:
    """A random checkpoint in the hub's dialect, with an MTP layer, at `root / "hub"`; returns its directory."""
    model = build(root / "hf", name)
    save_hub_dialect(model, root / "hub")
    return root / "hub"


def batched_logits(engine: Any, seqs: dict[str, list[int]], steps: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each (start, end) slice of every sequence as one batched step -> the logits of every step."""
    from shared.engine.attention import AttentionMetadata, SeqSpan  # only for the engine tests

    model, cache, bt = engine.model, engine.kv, engine.block_tokens
    tables = {rid: list(range(i * 4, i * 4 + 4)) for i, rid in enumerate(seqs)}
    for rid in seqs:
        cache.begin(rid, 0)
    out = []
    for a, b in steps:
        ids, pos, spans = [], [], []
        for rid, tokens in seqs.items():
            spans.append(SeqSpan(len(ids), b - a, b, torch.tensor(tables[rid][: -(-b // bt)]), rid))
            ids += tokens[a:b]
            pos += range(a, b)
        meta = AttentionMetadata(torch.zeros(len(ids), dtype=torch.long), spans)
        out.append(model.logits(model.forward(torch.tensor(ids), torch.tensor(pos), meta, cache)))
    return out
